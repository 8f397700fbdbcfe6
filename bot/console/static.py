"""The console's only script, served from ``/static/console.js``.

It lives in a Python string so the wheel needs no package data. The page's CSP
allows scripts from 'self' only, so this file is the whole of the client code:
no inline handlers, no eval, and data from agents is only ever placed with
``textContent`` — never parsed as HTML.
"""

from __future__ import annotations

CONSOLE_JS = r"""
"use strict";
(function () {
  var list = document.getElementById("messages");
  if (!list || !window.EventSource) { return; }
  var csrf = (document.querySelector('meta[name="kazma-csrf"]') || {}).content || "";
  var operator = ((document.querySelector('meta[name="kazma-role"]') || {}).content || "") === "operator";
  var status = document.getElementById("live");

  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) { node.className = cls; }
    if (text !== undefined && text !== null) { node.textContent = String(text); }
    return node;
  }

  function decideForm(requestId, decision, label) {
    var form = el("form", "inline");
    form.method = "post";
    form.action = "/approvals/" + encodeURIComponent(requestId) + "/decide";
    var fields = { csrf: csrf, decision: decision, next: "/" };
    Object.keys(fields).forEach(function (name) {
      var input = el("input");
      input.type = "hidden";
      input.name = name;
      input.value = fields[name];
      form.appendChild(input);
    });
    var button = el("button", decision, label);
    button.type = "submit";
    form.appendChild(button);
    return form;
  }

  function renderCard(card) {
    var box = el("div", "card");
    box.appendChild(el("div", "card-title", card.title));
    box.appendChild(el("div", "meta", "requested by " + card.requester + " in " + card.origin));
    var table = el("table", "args");
    card.arguments.forEach(function (arg) {
      var row = el("tr");
      row.appendChild(el("th", null, arg.name));
      var cell = el("td");
      cell.appendChild(el("pre", null, arg.head));
      if (arg.cut) {
        var omitted = arg.original_length - arg.head.length - arg.tail.length;
        var note = "[cut: " + omitted + " of " + arg.original_length + " characters not shown]";
        cell.appendChild(el("div", "cut", note));
        cell.appendChild(el("pre", null, arg.tail));
      }
      row.appendChild(cell);
      table.appendChild(row);
    });
    box.appendChild(table);
    box.appendChild(el("div", "hash", "SHA-256 " + card.hash));
    var link = el("a", null, "full call and audit trail");
    link.href = "/swarm?approval=" + encodeURIComponent(card.request_id);
    box.appendChild(link);
    var outcome = el("div", "outcome", card.outcome ? "Outcome: " + card.outcome : "");
    outcome.id = "o-" + card.request_id;
    box.appendChild(outcome);
    if (!card.outcome && operator) {
      var buttons = el("div", "buttons");
      buttons.id = "b-" + card.request_id;
      buttons.appendChild(decideForm(card.request_id, "approve", "Approve"));
      buttons.appendChild(decideForm(card.request_id, "deny", "Deny"));
      box.appendChild(buttons);
    }
    return box;
  }

  function addMessage(message) {
    if (document.getElementById("m-" + message.id)) { return; }
    var item = el("li", "message");
    item.id = "m-" + message.id;
    var head = el("div", "speaker", message.author);
    head.appendChild(el("span", "when", " " + new Date(message.at * 1000).toISOString()));
    item.appendChild(head);
    if (message.card) {
      item.appendChild(renderCard(message.card));
    } else {
      item.appendChild(el("pre", "text", message.text));
    }
    list.appendChild(item);
  }

  function settle(message) {
    if (!message.card) { return; }
    var id = message.card.request_id;
    var outcome = document.getElementById("o-" + id);
    if (!outcome) { addMessage(message); return; }
    outcome.textContent = "Outcome: " + (message.card.outcome || message.card.status || "decided");
    var buttons = document.getElementById("b-" + id);
    if (buttons) { buttons.parentNode.removeChild(buttons); }
  }

  var source = new EventSource("/events");
  source.onopen = function () { if (status) { status.textContent = "live"; } };
  source.onerror = function () { if (status) { status.textContent = "reconnecting…"; } };
  source.onmessage = function (event) {
    var data;
    try { data = JSON.parse(event.data); } catch (err) { return; }
    if (data.type === "message") { addMessage(data.message); }
    else if (data.type === "settled") { settle(data.message); }
  };
})();
"""
