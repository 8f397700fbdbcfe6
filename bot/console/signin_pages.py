"""HTML of the sign-in ceremonies: enrolling a passkey, a link that no longer works, the first account. Every
value escaped (:func:`~kazma.bot.console.pages.e`); no inline script. (The Telegram Mini App's landing page is
its module's, :mod:`kazma.bot.console.miniapp`.)"""

from __future__ import annotations

from collections.abc import Sequence

from kazma.adapters.web.render import e
from kazma.bot.console.accounts import InviteState
from kazma.bot.console.pages import PEOPLE_SCRIPT, Viewer, layout

_GONE = {
    InviteState.USED: ("This enrolment link was already used", "Each link enrols one passkey, once."),
    InviteState.EXPIRED: ("This enrolment link has expired", "Links are good for a day."),
    InviteState.UNKNOWN: ("This enrolment link is not valid", "It is not one Kazma made, or it was mistyped."),
    InviteState.USABLE: ("This enrolment link cannot be used now", ""),
}


def gone_page(state: InviteState, detail: str | None = None) -> str:
    title, why = _GONE[state]
    text = detail or f"{why} Ask for a new one: kazma people invite <person> prints it."
    body = f'<h1>{e(title)}</h1><p class="error" role="alert">{e(text)}</p><p><a href="/login">Sign in</a></p>'
    return layout(title, body)


def enrol_page(person: str, identity: str, token: str, *, problem: str | None) -> str:
    if problem is not None:
        action = f'<p class="error">Passkeys cannot work here: {e(problem)}</p>'
    else:
        action = (
            f'<p><button type="button" class="primary" id="passkey-enrol" data-options="/enrol/{e(token)}/options"'
            f' data-verify="/enrol/{e(token)}">Make a passkey for {e(person)}</button></p>'
            '<p class="error" id="passkey-error" role="alert" hidden></p>'
        )
    body = (
        f"<h1>Enrol a passkey</h1><p>This link makes a passkey for <strong>{e(person)}</strong> "
        f"(<code>{e(identity)}</code>) on this device: your device asks for your PIN, fingerprint or face. "
        "Afterwards you sign in with it, and every decision you make here is recorded as yours. The link works "
        f"once.</p>{action}"
    )
    return layout("Enrol a passkey", body, script=PEOPLE_SCRIPT)


def bootstrap_form(viewer: Viewer, people: Sequence[str]) -> str:
    """The first account's enrolment, offered to a session of the shared operator token while nobody holds a
    passkey (afterwards links come from ``kazma people invite``)."""
    if not people:
        return (
            '<p class="notice">Nobody holds a passkey yet, and no person under people: has a console identity that '
            "is an operator: add one (people.&lt;name&gt;.web, and the person in approvals.approvers), then "
            "enrol them here or with <code>kazma people invite &lt;name&gt;</code>.</p>"
        )
    options = "".join(f'<option value="{e(p)}">{e(p)}</option>' for p in people)
    return (
        '<section class="bootstrap"><h2>Enrol the first account</h2>'
        "<p>Nobody holds a passkey yet. The shared operator token reads only; it may make this one enrolment link, "
        "for the person you are, and never again once anybody holds a passkey.</p>"
        '<form method="post" action="/people/bootstrap">'
        f'<input type="hidden" name="csrf" value="{e(viewer.csrf)}">'
        f'<label>I am <select name="person">{options}</select></label> '
        '<button type="submit">Enrol my passkey</button></form></section>'
    )
