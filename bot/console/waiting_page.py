"""The console's Approvals page: what waits for the signed-in person (``/approvals`` in chat asks the same)."""

from __future__ import annotations

from collections.abc import Sequence

from kazma.adapters.web.render import e
from kazma.approvals.honesty import reveal_line
from kazma.approvals.waiting import WaitingList
from kazma.bot.console.pages import Viewer, approval_href, layout
from kazma.bot.console.times import when_html

NOBODY = (
    "A shared token is nobody: sign in as yourself (a passkey, or your platform) to see the approval requests "
    "waiting for you."
)


def waiting_page(viewer: Viewer, waiting: WaitingList | None, *, flash: Sequence[str] = ()) -> str:
    """``waiting``: what waits for the viewer (None: the session proves no person, so nothing is theirs)."""
    if waiting is None:
        body = f"<h1>Approvals</h1><p>{e(NOBODY)}</p>"
        return layout("Approvals", body, viewer=viewer, flash=flash)
    if not waiting.decides:
        said = f"You ({waiting.who}) may not decide approvals here, so nothing waits for you."
        return layout("Approvals", f"<h1>Approvals</h1><p>{e(said)}</p>", viewer=viewer, flash=flash)
    rows = "".join(
        f'<tr><td><a href="{e(approval_href(w.request.id))}">{e(w.request.id)}</a></td>'
        f"<td>{e(reveal_line(w.request.tool))}</td><td>{e(reveal_line(w.request.requested_by))}</td>"
        f"<td>{e(w.progress)}</td><td>{when_html(w.request.created_at)}</td>"
        f"<td>{when_html(w.request.deadline)}</td></tr>"
        for w in waiting.items
    )
    count = len(waiting.items)
    if count:
        summary = f"{count} approval request{'' if count == 1 else 's'} waiting for you ({waiting.who})."
        table = (
            "<table><tr><th>request</th><th>tool</th><th>asked by</th><th>progress</th><th>asked</th>"
            f"<th>decide by</th></tr>{rows}</table>"
        )
    else:
        summary = f"Nothing waits for you ({waiting.who}): no pending approval is yours to decide."
        table = ""
    body = f'<h1>Approvals</h1><p class="summary">{e(summary)}</p>{table}'
    return layout("Approvals", body, viewer=viewer, flash=flash, live=True)
