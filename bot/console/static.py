"""The console's only script, served from ``/static/console.js``.

It lives in a Python string so the wheel needs no package data. The page's CSP
allows scripts from 'self' only, so this file is the whole of the client code:
no inline handlers, no eval. Messages, cards and transcript entries arrive as
HTML fragments the server rendered for this viewer with the same writer as the
page itself (every value escaped there, forms signed with the session's CSRF
token); the script only places them, so the live view and a reload can never
differ. It also shows every ``<time>`` in the viewer's own time zone, in the one
format every page uses, and a quiet "working…" line while an agent works.
"""

from __future__ import annotations

CONSOLE_JS = r"""
"use strict";
(function () {
  function pad(n) { return (n < 10 ? "0" : "") + n; }
  var zone = "";
  try { zone = Intl.DateTimeFormat().resolvedOptions().timeZone || ""; } catch (err) { zone = ""; }

  // One format everywhere: 2026-12-01 14:03:09 Europe/Paris (the viewer's zone).
  function localise(root) {
    var times = (root || document).querySelectorAll("time[datetime]");
    for (var i = 0; i < times.length; i++) {
      var node = times[i];
      if (node.getAttribute("data-local")) { continue; }
      var at = new Date(node.getAttribute("datetime"));
      if (isNaN(at.getTime())) { continue; }
      node.textContent = at.getFullYear() + "-" + pad(at.getMonth() + 1) + "-" + pad(at.getDate()) + " " +
        pad(at.getHours()) + ":" + pad(at.getMinutes()) + ":" + pad(at.getSeconds()) + (zone ? " " + zone : "");
      node.setAttribute("data-local", "1");
      node.title = node.getAttribute("datetime");
    }
  }
  localise(document);

  var list = document.getElementById("messages");
  var transcript = document.getElementById("transcript");
  var conversations = document.getElementById("conversations");
  var working = document.getElementById("working");
  var dashboard = document.getElementById("dashboard");
  if ((!list && !transcript && !conversations && !dashboard) || !window.EventSource) { return; }
  var status = document.getElementById("live");
  var workingTimer = null;

  function fragment(html) {
    var template = document.createElement("template");
    template.innerHTML = html;
    return template.content.firstElementChild;
  }

  function clearWorking() { if (working) { working.textContent = ""; } }

  function place(into, html) {
    if (!into || !html) { return; }
    var node = fragment(html);
    if (!node) { return; }
    localise(node);
    var existing = document.getElementById(node.id);
    if (existing) { existing.replaceWith(node); return; }
    // in the order things happened: an entry goes before the first one that came later
    var seq = Number(node.getAttribute("data-seq") || "NaN");
    if (!isNaN(seq)) {
      var items = into.children;
      for (var i = 0; i < items.length; i++) {
        if (Number(items[i].getAttribute("data-seq")) > seq) { into.insertBefore(node, items[i]); return; }
      }
    }
    into.appendChild(node);
  }

  function showWorking(conversation) {
    if (!working || working.getAttribute("data-conversation") !== conversation) { return; }
    working.textContent = "An agent is working…";
    if (workingTimer) { clearTimeout(workingTimer); }
    workingTimer = setTimeout(clearWorking, 8000);
  }

  function touchConversation(data) {
    if (!conversations) { return; }
    var item = conversations.querySelector("li[data-conversation='" + CSS.escape(data.conversation) + "']");
    if (item) { conversations.insertBefore(item, conversations.firstChild); }
    else { conversations.setAttribute("data-stale", "1"); }
  }

  // a dashboard says which version it shows: the server sends a fresh one at once if it has changed since
  var source = new EventSource(dashboard ?
    "/events?dashboard=" + encodeURIComponent(dashboard.getAttribute("data-version") || "0") : "/events");
  source.onopen = function () { if (status) { status.textContent = "live"; } };
  source.onerror = function () { if (status) { status.textContent = "reconnecting…"; } };
  source.onmessage = function (event) {
    var data;
    try { data = JSON.parse(event.data); } catch (err) { return; }
    if ((data.type === "message" || data.type === "settled") && data.message) {
      if (list) { place(list, data.message.html); if (data.type === "message") { clearWorking(); } }
    } else if (data.type === "entry") {
      if (transcript && transcript.getAttribute("data-conversation") === data.conversation) {
        place(transcript, data.html);
        clearWorking();
      }
      touchConversation(data);
    } else if (data.type === "working") {
      showWorking(data.conversation);
    } else if (data.type === "dashboard" && dashboard && data.html) {
      var fresh = fragment(data.html);
      if (fresh) { localise(fresh); dashboard.replaceWith(fresh); dashboard = fresh; }
    }
  };
})();
"""
