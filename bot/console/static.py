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
    } else if (data.type === "approval") {
      // an approval's card in the conversation it was asked in: placed new, or replaced once it settles
      if (transcript && transcript.getAttribute("data-conversation") === data.conversation) {
        place(transcript, data.html);
      }
    } else if (data.type === "working") {
      showWorking(data.conversation);
    } else if (data.type === "dashboard" && dashboard && data.html) {
      var fresh = fragment(data.html);
      if (fresh) { localise(fresh); dashboard.replaceWith(fresh); dashboard = fresh; }
    }
  };
})();
"""

# The sign-in pages' script (``/static/people.js``): passkeys (WebAuthn) and the Telegram Mini App. WebAuthn
# takes and gives bytes; the server speaks base64url JSON (py_webauthn's forms): the conversions are here.
# Nothing is decided in the browser: the server checks every answer, and a refusal's reason is shown.
PEOPLE_JS = r"""
"use strict";
(function () {
  function toB64(buffer) {
    var bytes = new Uint8Array(buffer), text = "";
    for (var i = 0; i < bytes.length; i++) { text += String.fromCharCode(bytes[i]); }
    return btoa(text).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }
  function fromB64(text) {
    var plain = atob(text.replace(/-/g, "+").replace(/_/g, "/") + "===".slice((text.length + 3) % 4));
    var bytes = new Uint8Array(plain.length);
    for (var i = 0; i < plain.length; i++) { bytes[i] = plain.charCodeAt(i); }
    return bytes.buffer;
  }
  function say(text) {
    var box = document.getElementById("passkey-error");
    if (!box) { return; }
    box.textContent = text;
    box.hidden = false;
  }
  function post(url, body, csrf) {
    // A proven person's door (step-up) carries the session's CSRF token in a header; sign-in has none yet.
    var headers = { "Content-Type": "application/json" };
    if (csrf) { headers["X-CSRF-Token"] = csrf; }
    return fetch(url, {
      method: "POST", credentials: "same-origin", headers: headers, body: JSON.stringify(body || {})
    }).then(function (response) {
      return response.json().catch(function () { return {}; }).then(function (data) {
        if (!response.ok) { throw new Error(data.error || ("refused (" + response.status + ")")); }
        return data;
      });
    });
  }
  function descriptors(list) {
    return (list || []).map(function (item) { return Object.assign({}, item, { id: fromB64(item.id) }); });
  }
  function enrol(button) {
    return post(button.getAttribute("data-options")).then(function (options) {
      var key = options.publicKey;
      key.challenge = fromB64(key.challenge);
      key.user.id = fromB64(key.user.id);
      key.excludeCredentials = descriptors(key.excludeCredentials);
      return navigator.credentials.create({ publicKey: key });
    }).then(function (made) {
      return post(button.getAttribute("data-verify"), {
        id: made.id, rawId: toB64(made.rawId), type: made.type,
        response: {
          clientDataJSON: toB64(made.response.clientDataJSON),
          attestationObject: toB64(made.response.attestationObject),
          transports: made.response.getTransports ? made.response.getTransports() : []
        },
        clientExtensionResults: made.getClientExtensionResults(),
        authenticatorAttachment: made.authenticatorAttachment || null
      });
    });
  }
  function assert(button) {
    var csrf = button.getAttribute("data-csrf");
    return post(button.getAttribute("data-options"), {}, csrf).then(function (options) {
      var key = options.publicKey;
      key.challenge = fromB64(key.challenge);
      key.allowCredentials = descriptors(key.allowCredentials);
      return navigator.credentials.get({ publicKey: key });
    }).then(function (got) {
      return post(button.getAttribute("data-verify"), {
        id: got.id, rawId: toB64(got.rawId), type: got.type,
        response: {
          clientDataJSON: toB64(got.response.clientDataJSON),
          authenticatorData: toB64(got.response.authenticatorData),
          signature: toB64(got.response.signature),
          userHandle: got.response.userHandle ? toB64(got.response.userHandle) : null
        },
        clientExtensionResults: got.getClientExtensionResults(),
        authenticatorAttachment: got.authenticatorAttachment || null
      }, csrf);
    });
  }
  function wire(id, ceremony) {
    var button = document.getElementById(id);
    if (!button) { return; }
    if (!window.PublicKeyCredential) { say("This browser cannot use passkeys."); button.disabled = true; return; }
    button.addEventListener("click", function () {
      button.disabled = true;
      ceremony(button).then(function (done) { window.location.assign(done.next || "/"); })
        .catch(function (err) { say(err && err.message ? err.message : String(err)); button.disabled = false; });
    });
  }
  wire("passkey-enrol", enrol);
  wire("passkey-sign-in", assert);
  wire("passkey-step-up", assert);  // the same assertion, on the approval page

  // A Telegram Mini App: Telegram opened this page with its signed initData in the fragment.
  var app = document.getElementById("telegram-app");
  if (app) {
    var data = new URLSearchParams(window.location.hash.slice(1)).get("tgWebAppData");
    if (!data) {
      say("Telegram did not pass who opened this page: open it from the card's button in Telegram.");
      return;
    }
    post(app.getAttribute("data-verify"), { init_data: data, csrf: app.getAttribute("data-csrf") })
      .then(function (done) { window.location.replace(done.next || "/"); })
      .catch(function (err) { say(err && err.message ? err.message : String(err)); });
  }
})();
"""
