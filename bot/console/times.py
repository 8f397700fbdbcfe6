"""The console's one timestamp format: ``<time>`` elements in UTC, shown in the viewer's own zone by the script.

Every page and fragment writes times through :func:`when_html`, so the script (``localise`` in
:mod:`kazma.bot.console.static`) rewrites all of them alike: ``2026-12-01 14:03:09 Europe/Paris``. Without the
script (or before it runs) the same format reads in UTC. A time inside other text (a sentence, a flash) goes
through :func:`when_html` too, never through a format of its own.
"""

from __future__ import annotations

import html
from datetime import UTC, datetime

FORMAT = "%Y-%m-%d %H:%M:%S UTC"


def as_datetime(value: datetime | float) -> datetime:
    if isinstance(value, datetime):
        return value.astimezone(UTC)
    return datetime.fromtimestamp(value, UTC)


def when(value: datetime | float | None) -> str:
    """Plain text (no markup): for places that cannot hold an element, such as an SVG label's tooltip."""
    return "—" if value is None else as_datetime(value).strftime(FORMAT)


def when_html(value: datetime | float | None) -> str:
    """A ``<time>`` the page's script shows in the viewer's zone, in the one format every page uses."""
    if value is None:
        return "—"
    at = as_datetime(value)
    return f'<time datetime="{html.escape(at.isoformat(), quote=True)}">{html.escape(at.strftime(FORMAT))}</time>'
