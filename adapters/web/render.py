"""The web console's dialect: the card as an HTML fragment, every value escaped on the way out.

The console, its live updates and the approval page all show cards through
this one writer, so the web says what every chat platform says, in the same
order and with the same labels. The buttons are the page's to draw (they are
forms signed with the viewer's CSRF token), so the writer takes a callback.
Values are ``<pre>`` blocks, the only text whose lines are laid out; every
argument's name follows a bullet, as on the chat platforms.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Final

from kazma.adapters.card_layout import EMPTY_VALUE, CardView, LaidOut, lay_out
from kazma.approvals.card import ApprovalCard
from kazma.approvals.model import Outcome

ButtonsHtml = Callable[[CardView], str]


def e(value: object) -> str:
    """Escape anything for HTML text and attribute values."""
    return html.escape("" if value is None else str(value), quote=True)


def _no_buttons(view: CardView) -> str:
    return ""


class HtmlWriter:
    """Writes a :class:`CardView` as ``<div class="card">``; a web page has room for everything."""

    def __init__(self, buttons: ButtonsHtml = _no_buttons) -> None:
        self.buttons = buttons

    def write(self, view: CardView) -> str:
        rid = e(view.request_id)
        parts = [f'<div class="card" id="card-{rid}" data-request="{rid}">']
        outcome = e(view.outcome_text)
        status = e(view.outcome.status.value) if view.outcome is not None else "pending"
        parts.append(f'<div class="outcome {status}" id="o-{rid}">{outcome}</div>')
        parts.append(f'<div class="card-title">{e(view.title)}</div>')
        parts += [f'<div class="about">{e(line)}</div>' for line in view.about]
        parts += [f'<div class="warning" role="alert">⚠ {e(w)}</div>' for w in view.warnings]
        facts = "".join(f"<tr><th>{e(label)}</th><td><code>{e(value)}</code></td></tr>" for label, value in view.facts)
        parts.append(f'<table class="facts">{facts}</table>')
        rows = []
        for arg in view.arguments:
            if arg.cut:
                head = f"<pre>{e(arg.head)}</pre>" if arg.head else ""
                value = f'{head}<div class="cut">{e(arg.marker)}</div><pre>{e(arg.tail)}</pre>'
            elif arg.empty:
                value = f'<em class="empty">{e(EMPTY_VALUE)}</em>'
            else:
                value = f"<pre>{e(arg.head)}</pre>"
            rows.append(f"<tr><th>• {e(arg.name)}</th><td>{value}</td></tr>")
        parts.append(
            f'<div class="args-heading">{e(view.arguments_heading)}</div><table class="args">{"".join(rows)}</table>'
        )
        if view.names_only:
            names = "".join(f"<li>{e(name)}</li>" for name in view.names_only)
            parts.append(f'<div class="names-heading">{e(view.names_heading)}</div><ul class="names">{names}</ul>')
        if view.notice:
            parts.append(f'<div class="notice">{e(view.notice)}</div>')
        parts.append(f'<div class="link">{e(view.link_label)}: <a href="{e(view.link)}">{e(view.link)}</a></div>')
        if view.footer is not None:
            parts.append(f'<div class="witness">{e(view.footer[0])}: <code>{e(view.footer[1])}</code></div>')
        if view.buttons:
            parts.append(self.buttons(view))
        parts.append("</div>")
        return "".join(parts)

    def fits(self, written: str) -> bool:
        return True


def card_html(
    card: ApprovalCard,
    *,
    outcome: Outcome | None = None,
    buttons: ButtonsHtml = _no_buttons,
    approve_partial: bool = False,
) -> LaidOut[str]:
    return lay_out(card, HtmlWriter(buttons), outcome=outcome, approve_partial=approve_partial)


__all__: Final = ["ButtonsHtml", "HtmlWriter", "card_html", "e"]
