"""HTML for the web console: plain pages, every value escaped on the way out.

Nothing here trusts its input. Agent output, tool arguments, user names and
command answers all go through :func:`e` (the one HTML escape, ``kazma.adapters.web.render.e``), and the
pages carry no inline script, so the CSP can forbid it outright.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol
from urllib.parse import quote, urlencode

from kazma.adapters.admission import FileBounds, human_size
from kazma.adapters.card_layout import APPROVE_LABEL, DENY_LABEL, ButtonKind, CardView
from kazma.adapters.human_text import LABEL_PREFIX, for_humans
from kazma.adapters.web import WebMessage, render
from kazma.adapters.web.render import e
from kazma.approvals.card import ApprovalCard, CardIntegrityError, build_card, integrity_card
from kazma.approvals.honesty import reveal, reveal_line
from kazma.approvals.model import MAX_REASON, ApprovalRequest, Outcome, Status, Waits, decider_text, outcome_of
from kazma.approvals.rules import Rule, RuleState, definition_text
from kazma.approvals.store import AuditEvent, PostedCard
from kazma.approvals.withdrawal import POLL_GRACE
from kazma.bot.console.charts import CHART_STYLE
from kazma.bot.console.dashboard_charts import charts_html
from kazma.bot.console.dashboard_data import DashboardData
from kazma.bot.console.services import InlineApproval
from kazma.bot.console.swarm_views import call_rows, handoff_chain, worker_numbers
from kazma.bot.console.times import times_in, when_html
from kazma.config.address import Address
from kazma.engine.swarm.endings import ending_lines
from kazma.engine.swarm.limits import MAX_COMMAND_BYTES
from kazma.engine.swarm.store import TaskRecord
from kazma.engine.swarm.types import TaskStatus
from kazma.engine.transcript import Entry, Summary

_OUTCOME = re.compile(r'(<div class="outcome [a-z]+" id="o-[A-Za-z0-9_-]+">)([^<]*)(</div>)')
_DEADLINE = re.compile(r"(<tr><th>Deadline</th><td><code>)([^<]*)(</code>)")

CONSOLE_SCRIPT = "/static/console.js"
PEOPLE_SCRIPT = "/static/people.js"  # passkeys and the Telegram Mini App: the sign-in pages' script

# The approval page shows every value whole: no argument is long enough to be cut at this limit.
WHOLE = 2**62
MAX_TEXT = 8000  # characters of one console message (the send and upload forms, and the server's check)

_STYLE = """
:root { --bg: #f6f6f7; --fg: #1d1d1f; --panel: #fff; --muted: #666; --line: #d8d8dc; --accent: #2563eb;
  --head: #20232a; --headfg: #fff; --link: #9cdcfe; --flash: #fff5d6; --flashline: #e0c060; --err: #ffe3e3;
  --errline: #d66; --card: #c77d00; --approve: #2e7d32; --deny: #b00020; --label: #6b7280; }
@media (prefers-color-scheme: dark) {
  :root { --bg: #15171b; --fg: #e6e6e6; --panel: #1f2228; --muted: #9aa0a6; --line: #343840; --accent: #7aa2ff;
    --head: #0c0d10; --headfg: #e6e6e6; --link: #9cdcfe; --flash: #3a3215; --flashline: #8a7020; --err: #3d1d1f;
    --errline: #a44; --card: #d49a3a; --approve: #3f9a45; --deny: #d0384f; --label: #9aa0a6; }
}
* { box-sizing: border-box; }
body { font-family: system-ui, sans-serif; margin: 0; color: var(--fg); background: var(--bg); }
a { color: var(--accent); }
header { background: var(--head); color: var(--headfg); padding: .6em 1em; display: flex; gap: 1.2em;
  align-items: center; }
header a { color: var(--link); text-decoration: none; }
header a.here { text-decoration: underline; }
header .who { margin-left: auto; display: flex; gap: .6em; align-items: center; }
main { padding: 1em; max-width: 80em; }
pre { white-space: pre-wrap; word-break: break-word; margin: .2em 0; font-family: ui-monospace, monospace; }
table { border-collapse: collapse; margin: .4em 0; background: var(--panel); }
th, td { border: 1px solid var(--line); padding: .3em .55em; text-align: left; vertical-align: top; }
.flash { background: var(--flash); border: 1px solid var(--flashline); padding: .5em; margin-bottom: 1em;
  border-radius: 6px; }
.flash pre { white-space: pre; overflow-x: auto; }
.error { background: var(--err); border: 1px solid var(--errline); padding: .5em; border-radius: 6px; }
ol.messages { padding: 0; margin: 0; }
.message { list-style: none; background: var(--panel); margin: .5em 0; padding: .6em .8em; border-radius: 8px;
  border: 1px solid var(--line); border-left: 4px solid var(--agent, var(--line)); }
.speaker { font-weight: 600; display: flex; gap: .5em; align-items: baseline; color: var(--agent, var(--fg)); }
.when, .meta { color: var(--muted); font-weight: normal; font-size: .85em; }
.from { color: var(--label); font-size: .85em; font-style: italic; display: block; margin-top: .3em; }
.a0 { --agent: #2563eb; } .a1 { --agent: #16a34a; } .a2 { --agent: #c2410c; } .a3 { --agent: #9333ea; }
.a4 { --agent: #0891b2; } .a5 { --agent: #db2777; } .a6 { --agent: #65a30d; } .a7 { --agent: #b45309; }
.person { --agent: var(--muted); }
.badge { display: inline-block; font-size: .75em; font-weight: 600; padding: .05em .5em; border-radius: 999px;
  color: #fff; background: #555; vertical-align: middle; }
.badge.telegram { background: #229ed9; } .badge.slack { background: #4a154b; } .badge.discord { background: #5865f2; }
.badge.web { background: #374151; } .badge.dm { background: #7c3aed; }
.layout { display: grid; grid-template-columns: 18em 1fr; gap: 1em; align-items: start; }
.convs { list-style: none; padding: 0; margin: 0; }
.convs li a { display: block; padding: .5em .6em; border-radius: 6px; color: var(--fg); text-decoration: none;
  background: var(--panel); border: 1px solid var(--line); margin-bottom: .4em; }
.convs li a.here { border-color: var(--accent); }
.convs .last { color: var(--muted); font-size: .85em; display: block; white-space: nowrap; overflow: hidden;
  text-overflow: ellipsis; }
.working { color: var(--muted); font-style: italic; min-height: 1.4em; }
.card { border: 2px solid var(--card); padding: .6em; border-radius: 8px; background: var(--panel); }
.cut { color: var(--deny); font-weight: bold; }
.warning { background: var(--err); border: 1px solid var(--errline); padding: .3em; font-weight: bold; }
.notice { color: var(--card); font-style: italic; }
.hash { font-family: ui-monospace, monospace; font-size: .85em; }
.outcome { font-weight: bold; }
form.inline { display: inline; }
button, input[type=submit] { font: inherit; padding: .4em .9em; border-radius: 6px; border: 1px solid var(--line);
  background: var(--panel); color: var(--fg); cursor: pointer; }
button:hover { border-color: var(--accent); }
button[type=submit].primary, .send button { background: var(--accent); color: #fff; border-color: var(--accent); }
button.approve { background: var(--approve); color: #fff; border-color: var(--approve); }
button.deny { background: var(--deny); color: #fff; border-color: var(--deny); }
input, textarea { font: inherit; padding: .45em .6em; border-radius: 6px; border: 1px solid var(--line);
  background: var(--panel); color: var(--fg); }
textarea { width: 100%; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(20em, 1fr)); gap: 1em; margin: 1em 0; }
.chart { background: var(--panel); border: 1px solid var(--line); border-radius: 8px; padding: .6em; }
.chart svg { width: 100%; height: auto; color: var(--fg); }
.chart h3 { margin: 0 0 .4em 0; font-size: 1em; }
@media (max-width: 50em) { .layout { grid-template-columns: 1fr; } }
/* A phone (390 px) reads every page without scrolling sideways: the header wraps, long unbroken values (a
   hash, an id, a path) break anywhere, and only the wide record tables scroll, inside their own box. */
header { flex-wrap: wrap; row-gap: .3em; }
h1 code, .hash, .card code, table.record td { overflow-wrap: anywhere; }
.card table { width: 100%; table-layout: fixed; }
.card table th { width: 9em; }
.card table.args th { overflow-wrap: anywhere; }
.wide { overflow-x: auto; max-width: 100%; }
.decide { position: sticky; bottom: 0; background: var(--bg); border-top: 1px solid var(--line);
  padding: .6em 0; margin-top: .6em; z-index: 1; }
.decide .buttons { display: flex; flex-wrap: wrap; gap: .5em; align-items: center; }
.decide form.inline { display: flex; flex-wrap: wrap; gap: .5em; }
.decide input[name=reason] { min-width: 0; flex: 1 1 10em; }
details.canonical { margin: 1em 0; }
@media (max-width: 30em) { main { padding: .6em; } header { padding: .5em .6em; gap: .6em; }
  h1 code { font-size: .6em; } .card table th { width: 7em; }
  .card table.args th, .card table.args td { display: block; width: auto; border-bottom: 0; } }
"""


class Viewer(Protocol):
    """Who is looking: enough to label the page and sign its forms."""

    @property
    def login(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def csrf(self) -> str: ...

    @property
    def is_operator(self) -> bool: ...

    @property
    def may_decide(self) -> bool: ...

    def may_decide_under(self, policy: str | None) -> bool: ...

    @property
    def proven(self) -> bool: ...

    @property
    def who(self) -> str: ...


@dataclass(frozen=True)
class SignInChoices:
    """How people can sign in here, for the sign-in page."""

    passkey_problem: str | None = None  # why passkeys cannot work at this public URL (None: they can)
    platforms: tuple[tuple[str, str], ...] = ()  # (label, where the sign-in starts): Sign in with Slack, …


def agent_class(author: str) -> str:
    """A stable colour class per agent (``a0``…``a7``); people are drawn quietly."""
    if not author.startswith("agent:"):
        return "person"
    return f"a{sum(author.encode()) % 8}"


def badge(platform: str, *, direct: bool = False) -> str:
    dm = ' <span class="badge dm">DM</span>' if direct else ""
    return f'<span class="badge {e(platform)}">{e(platform.title())}</span>{dm}'


def approval_href(request_id: str) -> str:
    return f"/swarm?approval={quote(request_id, safe='')}"


def layout(
    title: str,
    body: str,
    *,
    viewer: Viewer | None = None,
    flash: Sequence[str] = (),
    live: bool = False,
    script: str | None = None,
    refresh_to: str | None = None,
) -> str:
    nav = ""
    meta = ""
    if viewer is not None:
        # the script reads these to sign the forms it builds for live cards
        meta = f'<meta name="kazma-csrf" content="{e(viewer.csrf)}"><meta name="kazma-role" content="{e(viewer.role)}">'
        nav = (
            '<a href="/">Console</a> <a href="/conversations">Conversations</a> <a href="/swarm">Swarm</a>'
            ' <a href="/approvals">Approvals</a>'
            f'<span class="who">{e(viewer.who)} · {e(viewer.role)} '
            f"{form('/logout', viewer, {}, 'Log out')}</span>"
        )
        live = True  # the script also shows every time in the viewer's own zone
    # A multi-line answer (/swarm help is a table) keeps its lines and columns.
    flashes = "".join(
        f'<div class="flash" role="status"><pre>{times_in(e(line))}</pre></div>'
        if "\n" in line
        else f'<div class="flash" role="status">{times_in(e(line))}</div>'
        for line in flash
    )
    scripts = [CONSOLE_SCRIPT] if live else []
    if script is not None:
        scripts.append(script)
    script_tags = "".join(f'<script src="{e(src)}" defer></script>' for src in scripts)
    refresh = f'<meta http-equiv="refresh" content="0;url={e(refresh_to)}">' if refresh_to else ""

    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{e(title)} · Kazma</title>{meta}{refresh}<style>{_STYLE}{CHART_STYLE}</style>{script_tags}</head>"
        f"<body><header><strong>Kazma</strong>{nav}</header><main>{flashes}{body}</main></body></html>\n"
    )


def form(action: str, viewer: Viewer, fields: Mapping[str, str], label: str, *, button_class: str = "") -> str:
    """A POST form carrying the session's CSRF token."""
    hidden = "".join(
        f'<input type="hidden" name="{e(name)}" value="{e(value)}">'
        for name, value in {"csrf": viewer.csrf, **fields}.items()
    )
    cls = f' class="{e(button_class)}"' if button_class else ""
    return (
        f'<form class="inline" method="post" action="{e(action)}">{hidden}'
        f'<button type="submit"{cls}>{e(label)}</button></form>'
    )


def deny_form(action: str, viewer: Viewer, next_path: str) -> str:
    """Deny, with an optional reason beside it: empty, it is one press."""
    hidden = "".join(
        f'<input type="hidden" name="{e(name)}" value="{e(value)}">'
        for name, value in {"csrf": viewer.csrf, "decision": "deny", "next": next_path}.items()
    )
    return (
        f'<form class="inline" method="post" action="{e(action)}">{hidden}'
        f'<input type="text" name="reason" maxlength="{MAX_REASON}" placeholder="Reason (optional)"'
        ' aria-label="Reason for denying (optional)">'
        f'<button type="submit" class="deny">{e(DENY_LABEL)}</button></form>'
    )


def decide_buttons(viewer: Viewer, request_id: str, next_path: str, *, approve: bool = True) -> str:
    action = f"/approvals/{quote(request_id, safe='')}/decide"
    deny = deny_form(action, viewer, next_path)
    if approve:
        fields = {"decision": "approve", "next": next_path}
        deny = form(action, viewer, fields, APPROVE_LABEL, button_class="approve") + " " + deny
    return f'<div class="buttons" id="b-{e(request_id)}">{deny}</div>'


def step_up_button(viewer: Viewer, request_id: str) -> str:
    """Approve under a step_up policy: the person's passkey signs a challenge for this request (people.js)."""
    base = f"/approvals/{quote(request_id, safe='')}/step-up"
    return (
        "<p>This call's policy asks for your passkey to approve it (Deny is one press).</p>"
        f'<p><button type="button" class="approve" id="passkey-step-up" data-options="{e(base)}/options"'
        f' data-verify="{e(base)}" data-csrf="{e(viewer.csrf)}">Approve with your passkey</button></p>'
        '<p class="error" id="passkey-error" role="alert" hidden></p>'
    )


def message_page(title: str, text: str, *, viewer: Viewer | None = None, link: tuple[str, str] | None = None) -> str:
    extra = f'<p><a href="{e(link[0])}">{e(link[1])}</a></p>' if link else ""
    return layout(title, f'<h1>{e(title)}</h1><p class="error">{e(text)}</p>{extra}', viewer=viewer)


def login_page(
    login_csrf: str,
    *,
    error: str | None = None,
    name: str = "",
    choices: SignInChoices | None = None,
    next_path: str = "/",
) -> str:
    """``next_path``: where signing in leads (a local path the caller checked with ``safe_next``); every way of
    signing in on this page carries it, so a card's link lands on its approval and not on the console."""
    choices = choices or SignInChoices()
    problem = f'<p class="error">{e(error)}</p>' if error else ""
    back = "" if next_path == "/" else f"?{urlencode({'next': next_path})}"
    if choices.passkey_problem is None:
        passkey = (
            '<p><button type="button" class="primary" id="passkey-sign-in" data-options="/login/passkey/options"'
            f' data-verify="{e("/login/passkey" + back)}">Sign in with a passkey</button></p>'
            '<p class="error" id="passkey-error" role="alert" hidden></p>'
            "<p>No passkey yet? Ask for an enrolment link: <code>kazma people invite &lt;you&gt;</code>.</p>"
        )
    else:
        passkey = f'<p class="error">Passkeys cannot work here: {e(choices.passkey_problem)}</p>'
    platforms = "".join(
        f'<p><a class="button" href="{e(href + back)}">{e(label)}</a></p>' for label, href in choices.platforms
    )
    going = (
        f'<p class="meta">After signing in you go back to <code>{e(next_path)}</code>.</p>' if next_path != "/" else ""
    )
    body = (
        f"<h1>Sign in</h1>{going}{problem}{passkey}{platforms}"
        "<h2>Read-only, with a shared token</h2>"
        "<p>The operator and reader tokens (printed when the console first started) open a read-only session: "
        "dashboards, and with the operator token the first account's enrolment while nobody has a passkey. "
        "A shared token never decides an approval. The name is a label only.</p>"
        '<form method="post" action="/login">'
        f'<input type="hidden" name="csrf" value="{e(login_csrf)}">'
        f'<input type="hidden" name="next" value="{e(next_path)}">'
        '<p><label>Name <input name="name" required maxlength="32" pattern="[A-Za-z0-9_.\\-]{1,32}"'
        f' autocomplete="username" value="{e(name)}"></label></p>'
        '<p><label>Token <input name="token" type="password" required autocomplete="current-password"></label></p>'
        '<p><button type="submit">Log in read-only</button></p></form>'
    )
    return layout("Sign in", body, script=PEOPLE_SCRIPT)


# -- the console ---------------------------------------------------------------------------------


def card_html(card: ApprovalCard, outcome: Outcome | None, viewer: Viewer, *, next_path: str = "/") -> str:
    """A console card: the one card layout, with Approve/Deny forms for operators (back to ``next_path``)."""

    def buttons(view: CardView) -> str:
        if not viewer.may_decide_under(card.policy):
            return ""
        approve = any(b.kind is ButtonKind.APPROVE for b in view.buttons)
        return decide_buttons(viewer, card.request_id, next_path, approve=approve)

    return card_times(render.card_html(card, outcome=outcome, buttons=buttons).written)


def card_times(written: str) -> str:
    """A card's outcome line and deadline (Kazma's own words, both before any argument) with their times as
    ``<time>``, like every page. Only the first match of each is touched: argument values are never rewritten."""
    for pattern in (_OUTCOME, _DEADLINE):
        written = pattern.sub(lambda m: m.group(1) + times_in(m.group(2)) + m.group(3), written, count=1)
    return written


def question_forms(message: WebMessage, viewer: Viewer) -> str:
    """A question's choices as buttons and a reply box; who may answer is the executor's to decide."""
    choices = "".join(
        form("/console/choose", viewer, {"message": message.id, "choice": str(i)}, label, button_class="choice")
        for i, (label, _) in enumerate(message.choices)
    )
    reply = (
        f'<form class="reply" method="post" action="/console/send">'
        f'<input type="hidden" name="csrf" value="{e(viewer.csrf)}">'
        f'<input type="hidden" name="reply_to" value="{e(message.id)}">'
        '<input name="text" maxlength="4000" required placeholder="Reply to answer">'
        '<button type="submit">Answer</button></form>'
    )
    return f'<div class="question">{choices}{reply}</div>'


def text_html(text: str) -> str:
    """Message text as people read it: fences meant for models shown as a quiet "from @agent" label."""
    lines = []
    for line in for_humans(text).split("\n"):
        if line.startswith(LABEL_PREFIX) and line.endswith(":"):
            lines.append(f'<span class="from">{e(line.removeprefix("↳ ").removesuffix(":"))}</span>')
        else:
            lines.append(e(line))
    joined = "\n".join(lines)
    return f'<pre class="text">{joined}</pre>'


def message_html(message: WebMessage, viewer: Viewer) -> str:
    if message.card is not None:
        content = card_html(message.card, message.outcome, viewer)
    elif message.file is not None:
        name, size = message.file
        href = f"/console/files/{quote(message.id, safe='')}"
        content = f'<p class="file">📎 <a href="{e(href)}" download="{e(name)}">{e(name)}</a> ({size:,} bytes)</p>'
    else:
        content = text_html(message.text)
        if message.question:
            content += question_forms(message, viewer)
    return (
        f'<li class="message {agent_class(message.author)}" id="m-{e(message.id)}">'
        f'<div class="speaker">{e(message.author)}<span class="when">{when_html(message.at)}</span></div>'
        f"{content}</li>"
    )


def entry_html(entry: Entry) -> str:
    """One message of any conversation, from the transcript."""
    content = text_html(entry.text)
    if entry.file_name is not None:
        content = f'<p class="file">📎 {e(entry.file_name)}</p>'
    return (
        f'<li class="message {agent_class(entry.author)}" id="t-{entry.seq}" data-seq="{entry.seq}">'
        f'<div class="speaker">{e(entry.name)} <span class="meta">{e(entry.author)}</span>'
        f'<span class="when">{when_html(entry.at)}</span></div>{content}</li>'
    )


def conversation_href(conversation: str) -> str:
    return f"/conversations/{quote(conversation, safe='')}"


def conversation_name(title: str, chat: str) -> str:
    """A conversation as people know it: its title, the platform's id beside it, quietly (ids are what configs and
    logs name); the id alone when the platform never said a title."""
    if not title:
        return f'<code class="chat-id">{e(chat)}</code>'
    return f'<span class="title">{e(reveal_line(title))}</span> <code class="chat-id meta">{e(chat)}</code>'


def conversation_list(summaries: Sequence[Summary], current: str | None) -> str:
    items = []
    for c in summaries:
        here = ' class="here"' if c.conversation == current else ""
        items.append(
            f'<li data-conversation="{e(c.conversation)}"><a href="{e(conversation_href(c.conversation))}"{here}>'
            f"{badge(c.platform, direct=c.direct)} {conversation_name(c.title, c.chat)} "
            f'<span class="meta">{c.messages} · {when_html(c.last_at)}</span>'
            f'<span class="last">{e(for_humans(c.last_text)[:120])}</span></a></li>'
        )
    return f'<ul class="convs" id="conversations">{"".join(items) or "<li>No conversations yet.</li>"}</ul>'


def approval_item(item: InlineApproval, viewer: Viewer) -> str:
    """The approval where it was asked: the console's card (Approve/Deny for an approver while it waits), its
    outcome once decided, and its page."""
    request = item.request
    return approval_card_item(
        item.card, outcome_of(request), request.created_at.timestamp(), viewer, changed=item.changed
    )


def approval_card_item(
    card: ApprovalCard, outcome: Outcome | None, at: float, viewer: Viewer, *, changed: bool = False
) -> str:
    """An approval's card as an item of its conversation (the page, and the live event that places it there)."""
    if changed:
        content = card_times(render.card_html(card, outcome=outcome).written)
    else:
        content = card_html(card, outcome, viewer, next_path=conversation_href(card.origin))
    link = f'<p><a href="{e(approval_href(card.request_id))}">The whole call and its record</a></p>'
    return (
        f'<li class="message approval" id="a-{e(card.request_id)}" data-request="{e(card.request_id)}">'
        f'<div class="speaker">Approval · {e(card.tool)}<span class="meta">'
        f'{e(card.requester)}</span><span class="when">{when_html(at)}</span>'
        f"</div>{content}{link}</li>"
    )


def _interleaved(entries: Sequence[Entry], approvals: Sequence[InlineApproval], viewer: Viewer) -> str:
    """Messages and approvals in the order they happened (an approval at the time it was asked)."""
    timed: list[tuple[float, int, str]] = [(entry.at, 0, entry_html(entry)) for entry in entries]
    timed += [(item.request.created_at.timestamp(), 1, approval_item(item, viewer)) for item in approvals]
    timed.sort(key=lambda t: (t[0], t[1]))
    return "".join(html for _, _, html in timed)


def conversations_page(
    viewer: Viewer,
    summaries: Sequence[Summary],
    current: str | None,
    entries: Sequence[Entry],
    *,
    approvals: Sequence[InlineApproval] = (),
    flash: Sequence[str] = (),
) -> str:
    """Every conversation Kazma serves (every platform, DMs too), and the chosen one, read-only and live; the
    approvals asked in it appear as their cards where they were asked."""
    if current is None:
        shown = "<p>Pick a conversation to read it. New messages appear as they happen.</p>"
    else:
        where = Address.parse(current)
        platform, chat = where.platform, where.chat
        summary = next((c for c in summaries if c.conversation == current), None)
        direct = summary.direct if summary is not None else False
        title = summary.title if summary is not None else ""
        items = _interleaved(entries, approvals, viewer)
        shown = (
            f"<h2>{badge(platform, direct=direct)} {conversation_name(title, chat)}</h2>"
            f'<ol class="messages" id="transcript" data-conversation="{e(current)}">{items}</ol>'
            f'<div class="working" id="working" data-conversation="{e(current)}"></div>'
        )
    body = (
        '<h1>Conversations <small id="live" class="meta"></small></h1>'
        f'<div class="layout"><nav>{conversation_list(summaries, current)}</nav><section>{shown}</section></div>'
    )
    return layout("Conversations", body, viewer=viewer, flash=flash, live=True)


def upload_form(viewer: Viewer, files: FileBounds) -> str:
    """Files for the agents (operators only), saved into the console's workspace like any platform's attachments."""
    if not viewer.is_operator or files.max_count <= 0:
        return ""
    size = human_size(files.max_bytes)
    return (
        '<form class="upload" method="post" action="/console/upload" enctype="multipart/form-data">'
        f'<input type="hidden" name="csrf" value="{e(viewer.csrf)}">'
        '<p><label>Files <input type="file" name="files" multiple required></label> '
        f'<input name="text" size="50" maxlength="{MAX_TEXT}" placeholder="@kazma what should be done with them?"> '
        '<button type="submit">Send files</button></p>'
        f'<p class="meta">Up to {files.max_count} files of at most {size} each (files.max_count, files.max_bytes); '
        "they are saved in the conversation's workspace under incoming/.</p></form>"
    )


def console_page(
    viewer: Viewer,
    messages: Iterable[WebMessage],
    *,
    flash: Sequence[str] = (),
    files: FileBounds | None = None,
    notice_html: str = "",
) -> str:
    items = "".join(message_html(m, viewer) for m in messages)
    body = (
        f'<h1>Console <small id="live" class="meta"></small></h1>{notice_html}'
        f'<ol class="messages" id="messages">{items}</ol>'
        '<div class="working" id="working" data-conversation="web:console"></div>'
        '<form class="send" method="post" action="/console/send">'
        f'<input type="hidden" name="csrf" value="{e(viewer.csrf)}">'
        f'<p><textarea name="text" rows="3" cols="80" maxlength="{MAX_TEXT}" required'
        ' placeholder="@kazma what should we do? (@worker to address a worker)"></textarea></p>'
        '<p><button type="submit">Send</button></p></form>'
        f"{upload_form(viewer, files or FileBounds())}"
    )
    return layout("Console", body, viewer=viewer, flash=flash, live=True)


# -- one approval --------------------------------------------------------------------------------


def _canonical_json(canonical: str) -> str:
    """The bytes the hash covers, folded away: the call itself is shown once, on the card above."""
    return (
        '<details class="canonical"><summary>Canonical JSON (what the hash covers)</summary>'
        f"<pre>{e(reveal(canonical))}</pre></details>"
    )


def _ran(events: Sequence[AuditEvent]) -> str:
    """What became of an approved call, from its audit events: the latest word on it."""
    for ev in reversed(events):
        if ev.event == "execution_lost":
            return ev.detail or "approved, but Kazma stopped before it finished"
        if ev.event == "execution_finished":
            return f"ran: {ev.detail or ''}".rstrip(": ")
        if ev.event == "execution_refused":
            return f"did not run: refused ({ev.detail or ''})"
        if ev.event == "execution_started":
            return "started, not finished yet"
    return "not yet"


def approval_page(
    viewer: Viewer,
    request: ApprovalRequest,
    events: Sequence[AuditEvent],
    cards: Sequence[PostedCard],
    *,
    public_url: str,
    flash: Sequence[str] = (),
    policy_configured: bool = True,
) -> str:
    try:
        whole = build_card(request, value_limit=WHOLE, public_url=public_url, cut_padding=False)
        changed = False
    except CardIntegrityError:
        # Changed outside Kazma: no value of it is shown (as on every card), and it cannot be approved here.
        whole = integrity_card(request, public_url=public_url)
        changed = True
    args = card_times(render.card_html(whole).written)
    if request.status is Status.PENDING:
        decided = "not yet"
    elif request.status.human:
        decided = (
            f"{e(request.status.value)} by {e(reveal_line(decider_text(request.decided_person, request.decided_by)))} "
            f"via {e(reveal_line(request.decided_via or ''))} "
            f"at {when_html(request.decided_at)}"
        )
    else:
        decided = (
            f"{e(request.status.value)} at {when_html(request.decided_at)} (not a denial): "
            f"{e(reveal_line(request.reason or ''))}"
        )
    # the card above says the tool, who asked, the deadline and the hash: these are the rest of the record
    facts: list[tuple[str, str]] = [
        ("Status", e(request.status.value)),
        *asker_facts(request),
        ("Where", e(reveal_line(request.conversation))),
        ("Task", e(reveal_line(request.task_id or "—"))),
        ("When", when_html(request.created_at)),
        ("Decided", decided),
        ("Policy", e(policy_text(request))),
        *([("Ran", e(reveal_line(_ran(events))))] if request.status is Status.APPROVED else []),
    ]
    fact_rows = "".join(f"<tr><th>{e(k)}</th><td>{v}</td></tr>" for k, v in facts)
    audit = "".join(
        f"<tr><td>{ev.seq}</td><td>{when_html(ev.at)}</td><td>{e(ev.event)}</td>"
        f"<td>{e(reveal_line(ev.actor or ''))}</td><td>{e(ev.person or '')}</td>"
        f"<td>{e(ev.platform or '')}</td><td>{times_in(e(reveal_line(ev.detail or '')))}</td></tr>"
        for ev in events
    )
    posted = "".join(
        f"<tr><td>{e(c.platform)}</td><td>{e(c.chat)}</td><td>{e(c.message_id)}</td><td>{when_html(c.posted_at)}</td>"
        f"<td>{when_html(c.settled_at) if c.settled_at else 'not yet'}</td><td>{e(c.settled_status or '')}</td></tr>"
        for c in cards
    )
    buttons = ""
    deciding = viewer.may_decide_under(request.policy)
    if request.status is Status.PENDING:
        buttons = (
            decide_buttons(viewer, request.id, approval_href(request.id), approve=not changed and not request.step_up)
            if deciding
            else f"<p>Pending. {e(cannot_decide_here(viewer, request.policy, configured=policy_configured))}</p>"
        )
        if deciding and request.step_up and not changed:
            buttons = step_up_button(viewer, request.id) + buttons
        # After the call, never above it: read first, then decide. Sticky, so a long call's buttons stay in
        # reach at the foot of the screen while it is read, and settle below its last line.
        buttons = f'<div class="decide" id="decide">{buttons}</div>'
    body = (
        f'<h1 class="approval-title">Approval <code>{e(request.id)}</code></h1>'
        '<section class="call" id="call"><p class="meta">The whole call: every argument uncut, exactly as stored '
        "with the request. Hidden, direction-changing and control characters are shown escaped as ⟨U+…⟩, so "
        f"what you read is what runs.</p>{args}{buttons}</section>"
        f"{'' if changed else _canonical_json(request.args_json)}"
        f'<h2>The request</h2><table class="record">{fact_rows}</table>'
        '<h2>Audit trail</h2><div class="wide"><table><tr><th>#</th><th>when</th><th>event</th><th>identity</th>'
        "<th>person</th><th>platform</th>"
        f"<th>detail</th></tr>{audit}</table></div>"
        '<h2>Cards posted</h2><div class="wide"><table><tr><th>platform</th><th>chat</th><th>message</th>'
        f"<th>posted</th><th>settled</th><th>shows</th></tr>{posted}</table></div>"
    )
    stepping = deciding and request.step_up and request.status is Status.PENDING
    return layout(
        f"Approval {request.id}", body, viewer=viewer, flash=flash, script=PEOPLE_SCRIPT if stepping else None
    )


def policy_text(request: ApprovalRequest) -> str:
    """The policy a request is decided under, for its page."""
    said = [f"{request.approve_needed} {'person approves' if request.approve_needed == 1 else 'people approve'}"]
    said.append(f"{request.deny_needed} {'denial ends it' if request.deny_needed == 1 else 'denials end it'}")
    if request.step_up:
        said.append("Approve only here, with a passkey")
    return f"{request.policy or 'default'}: {', '.join(said)}"


def cannot_decide_here(viewer: Viewer, policy: str | None = None, *, configured: bool = True) -> str:
    """Why this viewer has no Approve or Deny, and what would give them one. ``configured``: whether the
    request's policy is still configured (when not, nobody's press counts)."""
    if not configured:
        return (
            f"Its approvals policy {policy or 'default'!r} is no longer configured, so nobody can decide it: it "
            "ends at its deadline (or configure the policy again)."
        )
    if not viewer.proven:
        return (
            "A shared token reads only: to decide, sign in with a passkey (kazma people invite <you> prints an "
            "enrolment link), or open this page from the card's button in Telegram."
        )
    if viewer.may_decide and policy is not None:
        return f"{viewer.who} may not decide under policy {policy}: only its approvers can."
    return f"{viewer.who} is not an approver here: only approvers (approvals.approvers) can decide."


def asker_facts(request: ApprovalRequest) -> list[tuple[str, str]]:
    """How an asker at one of the doors (the API, /mcp, the CLI) waits, and when it last asked for its answer;
    nothing for a request of Kazma's own agents."""
    if request.waits is Waits.CONNECTION:
        waiting = "on an open /mcp call: withdrawn on every card if the call ends"
    elif request.waits is Waits.POLLING:
        waiting = f"asking again and again: withdrawn on every card if it stops asking for {POLL_GRACE:g} s"
    elif request.last_seen is not None:
        waiting = "not waiting: it may come back for the answer until the deadline"
    else:
        return []
    facts = [("Asker", e(waiting))]
    if request.waits is not Waits.CONNECTION:
        facts.append(("Last asked for the answer", when_html(request.last_seen)))
    return facts


# -- the swarm dashboard -------------------------------------------------------------------------


def _excerpt(text: object, limit: int = 300) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _task_actions(viewer: Viewer, task: TaskRecord) -> str:
    if not viewer.is_operator:
        return ""
    actions: list[tuple[str, str]] = []
    if not task.status.terminal:
        actions.append(("cancel", "Cancel"))
    if task.status is TaskStatus.PAUSED:
        actions += [("approve", "Approve"), ("reject", "Reject")]
    if task.status.terminal:
        actions.append(("retry", "Retry"))
    base = f"/swarm/tasks/{quote(task.id, safe='')}"
    return " ".join(form(f"{base}/{action}", viewer, {}, label) for action, label in actions)


def dashboard_page(viewer: Viewer, data: DashboardData, *, flash: Sequence[str] = ()) -> str:
    """The swarm dashboard: the command form, then :func:`dashboard_html`, which the event stream replaces live."""
    command = ""
    if viewer.is_operator:
        # outside the live part: a fresh fragment must never wipe what an operator is typing
        command = (
            "<h2>Start work</h2>"
            '<form method="post" action="/swarm/command">'
            f'<input type="hidden" name="csrf" value="{e(viewer.csrf)}">'
            f'<p>/swarm <input name="text" size="80" maxlength="{MAX_COMMAND_BYTES}" required'
            ' placeholder="dispatch researcher find the flaky test"></p>'
            '<p><button type="submit">Run</button></p></form>'
        )
    body = f'<h1>Swarm <small id="live" class="meta"></small></h1>{command}{dashboard_html(viewer, data)}'
    return layout("Swarm", body, viewer=viewer, flash=flash, live=True)


def dashboard_html(viewer: Viewer, data: DashboardData) -> str:
    """Everything on the dashboard that follows the swarm: one ``<div id="dashboard">``, rendered for ``viewer``
    (its forms carry the viewer's CSRF token), sent again over the event stream whenever what it shows changes."""
    task_rows = []
    for t in data.tasks:
        workers = t.request.get("resolved") or t.request.get("workers") or []
        output = (t.result or {}).get("output", "")
        tokens = (t.result or {}).get("tokens") or {}
        used = f"{int(tokens.get('prompt', 0))} + {int(tokens.get('completion', 0))}" if tokens else ""
        task_rows.append(
            f"<tr><td><code>{e(t.id)}</code></td><td>{e(t.status.value)}</td><td>{e(t.pattern)}</td>"
            f"<td>{e(', '.join(str(w) for w in workers))}{handoff_chain(t)}{call_rows(data.calls.get(t.id, ()))}</td>"
            f"<td>{e(t.current_step)}</td>"
            f"<td>{when_html(t.created_at)}</td><td>{when_html(t.finished_at)}</td>"
            f"<td>{e(_excerpt(output)) if output else ''}{_ending_html(t)}</td><td>{e(used)}</td>"
            f"<td>{e(t.error or '')}</td>"
            f"<td>{_task_actions(viewer, t)}</td></tr>"
        )
    summary = ", ".join(f"{n} {e(s)}" for s, n in data.counts.items() if n) or "no tasks"
    approval_rows = "".join(
        f'<tr><td><a href="{e(approval_href(a.id))}">{e(a.id)}</a></td><td>{e(reveal_line(a.tool))}</td>'
        f"<td>{e(a.status.value)}</td><td>{e(reveal_line(a.requested_by))}</td><td>{when_html(a.created_at)}</td>"
        f"<td>{when_html(a.last_seen) if a.last_seen else ''}</td>"
        f"<td>{e(reveal_line(decider_text(a.decided_person, a.decided_by)))}</td></tr>"
        for a in data.approvals
    )
    workers = "".join(f"<li>{e(line)}</li>" for line in data.worker_lines) or "<li>no workers configured</li>"
    taken = f" · as of {when_html(data.taken_at)}" if data.taken_at else ""
    return (
        f'<div id="dashboard" data-version="{data.version}">'
        f'<p class="summary">{summary}<span class="meta">{taken}</span></p>'
        f"{charts_html(data)}"
        "<h2>Tasks</h2><table><tr><th>id</th><th>status</th><th>pattern</th><th>workers</th><th>step</th>"
        "<th>created</th><th>finished</th><th>result</th><th>tokens (prompt + completion)</th><th>error</th>"
        "<th></th></tr>"
        f"{''.join(task_rows)}</table>"
        f"<h2>Workers</h2><ul>{workers}</ul>{worker_numbers(data.worker_days)}"
        "<h2>Recent approvals</h2><table><tr><th>id</th><th>tool</th><th>status</th><th>requested by</th>"
        f"<th>when</th><th>asker last asked</th><th>decided by</th></tr>{approval_rows}</table>"
        f"{rules_section(viewer, data.rules)}</div>"
    )


def _ending_html(task: TaskRecord) -> str:
    """What the task's tools did, and the answers it kept (swarm/endings.py): the same lines as /swarm status."""
    lines = ending_lines(task, limit=400)
    if not lines:
        return ""
    return '<div class="ending">' + "".join(f"<div>{e(reveal_line(line))}</div>" for line in lines) + "</div>"


def rules_section(viewer: Viewer, rules: Sequence[tuple[Rule, RuleState]]) -> str:
    """Remembered approvals whose rows are in force ("Approve for 1 h"): each lets one exact call run again
    without a card while its state is ``active``; one the configuration ended, or whose seal does not hold, says
    so (and keeps its Revoke: an ended rule stands again if the configuration changes back)."""
    if not rules:
        return "<h2>Remembered approvals</h2><p>None in force.</p>"
    rows = []
    for r, state in rules:
        said = state.name if state.why is None else f"{state.name}: {state.why}"
        revoke = (
            form(f"/approvals/rules/{quote(r.id, safe='')}/revoke", viewer, {}, "Revoke") if viewer.is_operator else ""
        )
        rows.append(
            f"<tr><td><code>{e(r.id)}</code></td><td>{e(said)}</td><td>{e(reveal_line(r.tool))}</td>"
            f"<td><code>{e(r.args_hash[:16])}…</code></td><td><code>{e(definition_text(r))}</code></td>"
            f"<td>{e(r.conversation)}</td><td>{e(r.created_by)}</td>"
            f"<td>{when_html(datetime.fromtimestamp(r.expires_at, UTC))}</td><td>{revoke}</td></tr>"
        )
    return (
        "<h2>Remembered approvals</h2><p>Each active one lets the identical call (same tool, same argument hash, "
        "and for an MCP tool the definition its card showed) run again in its conversation without a card until it "
        "ends.</p><table><tr><th>rule</th><th>state</th><th>tool</th><th>sha256</th><th>definition</th>"
        f"<th>conversation</th><th>made by</th><th>until</th><th></th></tr>{''.join(rows)}</table>"
    )
