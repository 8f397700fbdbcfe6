"""HTML for the web console: plain pages, every value escaped on the way out.

Nothing here trusts its input. Agent output, tool arguments, user names and
command answers all go through :func:`e` (``html.escape`` with quotes), and the
pages carry no inline script, so the CSP can forbid it outright.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Protocol
from urllib.parse import quote

from kazma.adapters.card_layout import APPROVE_LABEL, DENY_LABEL, ButtonKind, CardView
from kazma.adapters.web import WebMessage, render
from kazma.approvals.card import ApprovalCard, build_card
from kazma.approvals.honesty import reveal
from kazma.approvals.model import ApprovalRequest, Outcome, Status
from kazma.approvals.store import AuditEvent, PostedCard
from kazma.bot.console.swarm_views import handoff_chain, worker_numbers
from kazma.engine.swarm.state_store import WorkerDay
from kazma.engine.swarm.store import TaskRecord
from kazma.engine.swarm.types import TaskStatus

# The approval page shows every value whole: no argument is long enough to be cut at this limit.
WHOLE = 2**62

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 0; color: #1d1d1f; background: #f6f6f7; }
header { background: #20232a; color: #fff; padding: .6em 1em; display: flex; gap: 1.2em; align-items: center; }
header a { color: #9cdcfe; }
header .who { margin-left: auto; }
main { padding: 1em; max-width: 70em; }
pre { white-space: pre-wrap; word-break: break-word; margin: .2em 0; font-family: ui-monospace, monospace; }
table { border-collapse: collapse; margin: .4em 0; }
th, td { border: 1px solid #ccc; padding: .25em .5em; text-align: left; vertical-align: top; }
.flash { background: #fff5d6; border: 1px solid #e0c060; padding: .5em; margin-bottom: 1em; }
.flash pre { white-space: pre; overflow-x: auto; }
.error { background: #ffe3e3; border: 1px solid #d66; padding: .5em; }
.message { list-style: none; background: #fff; margin: .4em 0; padding: .5em; border-radius: 4px; }
.speaker { font-weight: bold; }
.when, .meta { color: #666; font-weight: normal; font-size: .85em; }
.card { border: 2px solid #c77d00; padding: .5em; border-radius: 4px; }
.cut { color: #b00020; font-weight: bold; }
.warning { background: #ffe3e3; border: 1px solid #d66; padding: .3em; font-weight: bold; }
.notice { color: #8a5a00; font-style: italic; }
.hash { font-family: ui-monospace, monospace; font-size: .85em; }
.outcome { font-weight: bold; }
form.inline { display: inline; }
button.approve { background: #2e7d32; color: #fff; }
button.deny { background: #b00020; color: #fff; }
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


def e(value: object) -> str:
    """Escape anything for HTML text and attribute values."""
    return html.escape("" if value is None else str(value), quote=True)


def when(value: datetime | float | None) -> str:
    if value is None:
        return "—"
    if isinstance(value, float | int):
        value = datetime.fromtimestamp(value, UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def approval_href(request_id: str) -> str:
    return f"/swarm?approval={quote(request_id, safe='')}"


def layout(
    title: str,
    body: str,
    *,
    viewer: Viewer | None = None,
    flash: Sequence[str] = (),
    live: bool = False,
    refresh: int | None = None,
) -> str:
    nav = ""
    meta = ""
    if viewer is not None:
        # the script reads these to sign the forms it builds for live cards
        meta = f'<meta name="kazma-csrf" content="{e(viewer.csrf)}"><meta name="kazma-role" content="{e(viewer.role)}">'
        nav = (
            '<a href="/">Console</a> <a href="/swarm">Swarm</a>'
            f'<span class="who">web:{e(viewer.login)} ({e(viewer.role)}) '
            f"{form('/logout', viewer, {}, 'Log out')}</span>"
        )
    # A multi-line answer (/swarm help is a table) keeps its lines and columns.
    flashes = "".join(
        f'<div class="flash" role="status"><pre>{e(line)}</pre></div>'
        if "\n" in line
        else f'<div class="flash" role="status">{e(line)}</div>'
        for line in flash
    )
    script = '<script src="/static/console.js" defer></script>' if live else ""
    if refresh is not None:  # the dashboard follows the swarm by reloading; no script needed
        meta += f'<meta http-equiv="refresh" content="{int(refresh)}">'

    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{e(title)} · Kazma</title>{meta}<style>{_STYLE}</style>{script}</head>"
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


def decide_buttons(viewer: Viewer, request_id: str, next_path: str, *, approve: bool = True) -> str:
    action = f"/approvals/{quote(request_id, safe='')}/decide"
    deny = form(action, viewer, {"decision": "deny", "next": next_path}, DENY_LABEL, button_class="deny")
    if approve:
        fields = {"decision": "approve", "next": next_path}
        deny = form(action, viewer, fields, APPROVE_LABEL, button_class="approve") + " " + deny
    return f'<div class="buttons" id="b-{e(request_id)}">{deny}</div>'


def message_page(title: str, text: str, *, viewer: Viewer | None = None, link: tuple[str, str] | None = None) -> str:
    extra = f'<p><a href="{e(link[0])}">{e(link[1])}</a></p>' if link else ""
    return layout(title, f'<h1>{e(title)}</h1><p class="error">{e(text)}</p>{extra}', viewer=viewer)


def login_page(login_csrf: str, *, error: str | None = None, name: str = "") -> str:
    problem = f'<p class="error">{e(error)}</p>' if error else ""
    body = (
        f"<h1>Log in</h1>{problem}"
        '<form method="post" action="/login">'
        f'<input type="hidden" name="csrf" value="{e(login_csrf)}">'
        '<p><label>Name <input name="name" required maxlength="32" pattern="[A-Za-z0-9_.\\-]{1,32}"'
        f' autocomplete="username" value="{e(name)}"></label></p>'
        '<p><label>Token <input name="token" type="password" required autocomplete="current-password"></label></p>'
        '<p><button type="submit">Log in</button></p></form>'
        "<p>The operator and reader tokens were printed when the console first started.</p>"
    )
    return layout("Log in", body)


# -- the console ---------------------------------------------------------------------------------


def card_html(card: ApprovalCard, outcome: Outcome | None, viewer: Viewer) -> str:
    """A console card: the one card layout, with Approve/Deny forms for operators."""

    def buttons(view: CardView) -> str:
        if not viewer.is_operator:
            return ""
        approve = any(b.kind is ButtonKind.APPROVE for b in view.buttons)
        return decide_buttons(viewer, card.request_id, "/", approve=approve)

    return render.card_html(card, outcome=outcome, buttons=buttons).written


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


def message_html(message: WebMessage, viewer: Viewer) -> str:
    if message.card is not None:
        content = card_html(message.card, message.outcome, viewer)
    else:
        content = f'<pre class="text">{e(message.text)}</pre>'
        if message.question:
            content += question_forms(message, viewer)
    return (
        f'<li class="message" id="m-{e(message.id)}">'
        f'<div class="speaker">{e(message.author)}<span class="when"> {e(when(message.at))}</span></div>'
        f"{content}</li>"
    )


def console_page(viewer: Viewer, messages: Iterable[WebMessage], *, flash: Sequence[str] = ()) -> str:
    items = "".join(message_html(m, viewer) for m in messages)
    body = (
        '<h1>Console <small id="live" class="meta"></small></h1>'
        f'<ol id="messages">{items}</ol>'
        '<form method="post" action="/console/send">'
        f'<input type="hidden" name="csrf" value="{e(viewer.csrf)}">'
        '<p><textarea name="text" rows="3" cols="80" maxlength="8000" required'
        ' placeholder="@kazma what should we do? (@worker to address a worker)"></textarea></p>'
        '<p><button type="submit">Send</button></p></form>'
    )
    return layout("Console", body, viewer=viewer, flash=flash, live=True)


# -- one approval --------------------------------------------------------------------------------


def approval_page(
    viewer: Viewer,
    request: ApprovalRequest,
    events: Sequence[AuditEvent],
    cards: Sequence[PostedCard],
    *,
    public_url: str,
    flash: Sequence[str] = (),
) -> str:
    whole = build_card(request, value_limit=WHOLE, public_url=public_url)
    args = render.card_html(whole).written
    pretty = json.dumps(request.args, indent=2, sort_keys=True, ensure_ascii=False)
    if request.status is Status.PENDING:
        decided = "not yet"
    elif request.status.human:
        decided = (
            f"{request.status.value} by {request.decided_by} via {request.decided_via} at {when(request.decided_at)}"
        )
    else:
        decided = f"{request.status.value} at {when(request.decided_at)} (not a denial): {request.reason or ''}"
    facts = [
        ("Tool", request.tool),
        ("Status", request.status.value),
        ("SHA-256 of the canonical arguments", request.args_hash),
        ("Requested by", request.requested_by),
        ("Where", request.conversation),
        ("Task", request.task_id or "—"),
        ("When", when(request.created_at)),
        ("Deadline", when(request.deadline)),
        ("Decided", decided),
    ]
    fact_rows = "".join(f"<tr><th>{e(k)}</th><td>{e(reveal(v))}</td></tr>" for k, v in facts)
    audit = "".join(
        f"<tr><td>{ev.seq}</td><td>{e(when(ev.at))}</td><td>{e(ev.event)}</td><td>{e(ev.actor or '')}</td>"
        f"<td>{e(ev.platform or '')}</td><td>{e(ev.detail or '')}</td></tr>"
        for ev in events
    )
    posted = "".join(
        f"<tr><td>{e(c.platform)}</td><td>{e(c.chat)}</td><td>{e(c.message_id)}</td><td>{e(when(c.posted_at))}</td>"
        f"<td>{e(when(c.settled_at) if c.settled_at else 'not yet')}</td><td>{e(c.settled_status or '')}</td></tr>"
        for c in cards
    )
    buttons = ""
    if request.status is Status.PENDING:
        buttons = (
            decide_buttons(viewer, request.id, approval_href(request.id))
            if viewer.is_operator
            else "<p>Pending. Only operators can decide.</p>"
        )
    body = (
        f"<h1>Approval {e(request.id)}</h1>"
        f"<table>{fact_rows}</table>{buttons}"
        "<h2>The whole call</h2><p>Every argument, uncut, exactly as stored with the request.</p>"
        f"{args}"
        f"<h3>Arguments as JSON</h3><pre>{e(reveal(pretty))}</pre>"
        f"<h3>Canonical JSON (what the hash covers)</h3><pre>{e(reveal(request.args_json))}</pre>"
        "<p>Hidden, direction-changing and control characters are shown escaped as ⟨U+…⟩ everywhere on this"
        " page, so what you read is what runs.</p>"
        "<h2>Audit trail</h2><table><tr><th>#</th><th>when</th><th>event</th><th>actor</th><th>platform</th>"
        f"<th>detail</th></tr>{audit}</table>"
        "<h2>Cards posted</h2><table><tr><th>platform</th><th>chat</th><th>message</th><th>posted</th>"
        f"<th>settled</th><th>shows</th></tr>{posted}</table>"
    )
    return layout(f"Approval {request.id}", body, viewer=viewer, flash=flash)


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


def dashboard_page(
    viewer: Viewer,
    tasks: Sequence[TaskRecord],
    worker_lines: Sequence[str],
    approvals: Sequence[ApprovalRequest],
    counts: Mapping[str, int],
    *,
    flash: Sequence[str] = (),
    worker_days: Sequence[WorkerDay] = (),
) -> str:
    task_rows = []
    for t in tasks:
        workers = t.request.get("resolved") or t.request.get("workers") or []
        output = (t.result or {}).get("output", "")
        tokens = (t.result or {}).get("tokens") or {}
        used = f"{int(tokens.get('prompt', 0))} + {int(tokens.get('completion', 0))}" if tokens else ""
        task_rows.append(
            f"<tr><td><code>{e(t.id)}</code></td><td>{e(t.status.value)}</td><td>{e(t.pattern.value)}</td>"
            f"<td>{e(', '.join(str(w) for w in workers))}{handoff_chain(t)}</td><td>{e(t.current_step)}</td>"
            f"<td>{e(when(t.created_at))}</td><td>{e(when(t.finished_at))}</td>"
            f"<td>{e(_excerpt(output)) if output else ''}</td><td>{e(used)}</td><td>{e(t.error or '')}</td>"
            f"<td>{_task_actions(viewer, t)}</td></tr>"
        )
    summary = ", ".join(f"{n} {e(s)}" for s, n in counts.items() if n) or "no tasks"
    approval_rows = "".join(
        f'<tr><td><a href="{e(approval_href(a.id))}">{e(a.id)}</a></td><td>{e(a.tool)}</td>'
        f"<td>{e(a.status.value)}</td><td>{e(a.requested_by)}</td><td>{e(when(a.created_at))}</td>"
        f"<td>{e(a.decided_by or '')}</td></tr>"
        for a in approvals
    )
    command = ""
    if viewer.is_operator:
        command = (
            "<h2>Start work</h2>"
            '<form method="post" action="/swarm/command">'
            f'<input type="hidden" name="csrf" value="{e(viewer.csrf)}">'
            '<p>/swarm <input name="text" size="80" maxlength="8000" required'
            ' placeholder="dispatch researcher find the flaky test"></p>'
            '<p><button type="submit">Run</button></p></form>'
        )
    workers = "".join(f"<li>{e(line)}</li>" for line in worker_lines) or "<li>no workers configured</li>"
    body = (
        f"<h1>Swarm</h1><p>{summary}</p>{command}"
        "<h2>Tasks</h2><table><tr><th>id</th><th>status</th><th>pattern</th><th>workers</th><th>step</th>"
        "<th>created</th><th>finished</th><th>result</th><th>tokens (prompt + completion)</th><th>error</th>"
        "<th></th></tr>"
        f"{''.join(task_rows)}</table>"
        f"<h2>Workers</h2><ul>{workers}</ul>{worker_numbers(worker_days)}"
        "<h2>Recent approvals</h2><table><tr><th>id</th><th>tool</th><th>status</th><th>requested by</th>"
        f"<th>when</th><th>decided by</th></tr>{approval_rows}</table>"
    )
    return layout("Swarm", body, viewer=viewer, flash=flash, refresh=5)
