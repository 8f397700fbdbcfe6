"""Withdrawn requests: a synchronous asker went away, so nobody would act on an answer.

A request opened by a door whose asker waits for the answer (``/mcp``,
``kazma mcp serve``, ``kazma approvals request --wait``, ``require_approval``)
ends ``cancelled`` when that asker goes away, with one of these reasons on
every card. It is not a denial (invariant 2): nobody said no, and nothing ran.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

PREFIX: Final = "withdrawn: "

# A polling asker (``Waits.POLLING``) that has not asked for its answer for this long is gone. Its polls wait
# at most 60 s on the server (the API's longest ``?wait``), and ``last_seen`` is written at most every
# SEEN_EVERY seconds: a live asker is seen again well within this.
POLL_GRACE: Final = 90.0
SEEN_EVERY: Final = 10.0


class Gone(StrEnum):
    """Why the asker went away, as the card says it after ``withdrawn: ``."""

    DISCONNECTED = "the MCP client disconnected"
    INTERRUPTED = "the asker's process was interrupted"
    CANCELLED = "the asking call was cancelled"
    RESTARTED = "Kazma restarted while it waited"
    STOPPED = "Kazma stopped while it waited"
    REPLICA_STOPPED = "the replica holding the wait stopped"
    SILENT = "the asker stopped asking for the answer"


def withdrawn(why: Gone) -> str:
    """The reason stored with the request (and shown on its cards)."""
    return f"{PREFIX}{why.value}"


def by_asker(actor: str) -> str:
    """The reason of a request its asker withdrew on purpose (``DELETE`` with no ``why``)."""
    return f"withdrawn by {actor}"


def is_withdrawn(reason: str | None) -> bool:
    """Whether a cancelled request's reason says its asker withdrew it or went away (not a restart's orphan)."""
    return reason is not None and reason.startswith("withdrawn")
