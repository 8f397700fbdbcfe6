"""The console's only script, served from ``/static/console.js``.

It lives in a Python string so the wheel needs no package data. The page's CSP
allows scripts from 'self' only, so this file is the whole of the client code:
no inline handlers, no eval. Messages and cards arrive as HTML fragments the
server rendered for this viewer with the same writer as the page itself (every
value escaped there, forms signed with the session's CSRF token); the script
only places them, so the live view and a reload can never differ.
"""

from __future__ import annotations

CONSOLE_JS = r"""
"use strict";
(function () {
  var list = document.getElementById("messages");
  if (!list || !window.EventSource) { return; }
  var status = document.getElementById("live");

  function fragment(html) {
    var template = document.createElement("template");
    template.innerHTML = html;
    return template.content.firstElementChild;
  }

  function place(message) {
    if (!message.html) { return; }
    var node = fragment(message.html);
    if (!node) { return; }
    var existing = document.getElementById(node.id);
    if (existing) { existing.replaceWith(node); } else { list.appendChild(node); }
  }

  var source = new EventSource("/events");
  source.onopen = function () { if (status) { status.textContent = "live"; } };
  source.onerror = function () { if (status) { status.textContent = "reconnecting…"; } };
  source.onmessage = function (event) {
    var data;
    try { data = JSON.parse(event.data); } catch (err) { return; }
    if ((data.type === "message" || data.type === "settled") && data.message) { place(data.message); }
  };
})();
"""
