"""The console's one timestamp format: ``<time>`` elements in UTC, shown in the viewer's own zone by the script.

Every page and fragment writes times through :func:`when_html`, so the script (``localise`` in
:mod:`kazma.bot.console.static`) rewrites all of them alike: ``2026-12-01 14:03:09 Europe/Paris``. Without the
script (or before it runs) the same format reads in UTC. A time inside other text (a sentence, a flash) goes
through :func:`when_html` too, never through a format of its own.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

from kazma.adapters.web.render import e

FORMAT = "%Y-%m-%d %H:%M:%S UTC"
# A time said in that format inside Kazma's own text (a /swarm answer), or as epoch seconds after "until " in an
# audit detail (a remembered approval's end): both become <time> so they read like every other time on the page.
_SAID = re.compile(r"\b(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}) UTC\b")
_UNTIL_EPOCH = re.compile(r"\buntil (\d{9,11})(?:\.\d+)?\b")


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
    return f'<time datetime="{e(at.isoformat())}">{e(at.strftime(FORMAT))}</time>'


def times_in(escaped: str) -> str:
    """Already escaped text with each time it states (see ``_SAID``) written as ``<time>``: Kazma's own answers
    (a ``/swarm list`` in a flash, an audit detail), never agent output, which is shown as said."""

    def said(match: re.Match[str]) -> str:
        return when_html(datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC))

    def epoch(match: re.Match[str]) -> str:
        return f"until {when_html(float(match.group(1)))}"

    return _UNTIL_EPOCH.sub(epoch, _SAID.sub(said, escaped))
