"""What a platform call was doing when a bound around it ran out: told, not a bare ``TimeoutError``.

The bus bounds every card post and edit with its own ``platform_timeout``. That bound starts before the adapter's
request timeout and so usually ends the call first: it cancels the call, which then classifies nothing (a
cancellation is no failure of the platform's), and all the bus saw was ``TimeoutError`` — the card outbox's last
error and the log said neither whether the platform had not answered, had answered 429 and was being waited out,
or had answered 5xx and was being tried again. A :class:`CallNote` is kept as the calls under such a bound go (by
the kit's call, the shared pacing and a dialect that sees its library's own retries), and :func:`within` turns a
bound that ran out into the :class:`CutShort` error it was, with the wait still left when it was a rate limit.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Literal, TypeVar

from kazma.adapters.contract import PlatformError
from kazma.config.registry import CHAT_PLATFORMS

T = TypeVar("T")

Phase = Literal["sent", "turn", "retry"]


def title_of(platform: str) -> str:
    """The platform's name for people ("Telegram"), from its registry entry; the key itself for one not there."""
    spec = CHAT_PLATFORMS.get(platform)
    return platform if spec is None else spec.title


@dataclass
class CallNote:
    """The last platform call under one bound: where it was (``phase``) and the last failed answer it had."""

    platform: str | None = None
    site: str | None = None
    # "sent": a request is out, no answer yet; "turn": waiting for the chat's turn in Kazma's pacing (nothing sent);
    # "retry": answered with a failure (``answer``) and waiting to try again
    phase: Phase = "sent"
    answer: str | None = None  # the last failed answer: who answered what ("Slack answered ratelimited")
    retry_after: float | None = None  # the wait that answer asked for (a 429)
    answered_at: float = 0.0  # time.monotonic() of that answer

    def left(self, now: float) -> float:
        """How much of the asked-for wait is still to go at ``now``."""
        return max(0.0, self.answered_at + (self.retry_after or 0.0) - now)

    def told(self, platform: str, site: str, seconds: float, now: float) -> CutShort:
        """The bound of ``seconds`` around ``site`` ran out at ``now``: what was happening, as a retryable error."""
        title = title_of(self.platform or platform)
        # the call that was under way, where it is not the bound's own site (a card post's direct chat opened)
        call = f" in its {self.site} call" if self.site and self.site != site else ""
        bound = f"Kazma's {seconds:g} s bound on the {site}{call}"
        answer = self.answer
        before = f"; before that {answer}, and it was tried again" if answer else ""
        left = self.left(now)
        asked = "" if "retry after" in (answer or "") else f" (retry after {self.retry_after or 0:g} s)"
        if self.retry_after is not None and self.phase != "sent" and left > 0:
            message = (
                f"rate limited: {answer}{asked}; {bound} ran out while waiting it out ({left:.2g} s still to wait)"
            )
            return CutShort(platform, site, message, retry_after=left)
        if self.phase == "turn":
            message = f"not sent: still waiting for the chat's turn in Kazma's pacing when {bound} ran out{before}"
            return CutShort(platform, site, message)
        if self.phase == "retry" and answer:
            return CutShort(platform, site, f"{answer}, and {bound} ran out before it was tried again")
        return CutShort(platform, site, f"no answer from {title} within {seconds:g} s ({site}{call}){before}")


class CutShort(PlatformError):
    """A platform call ended by a caller's bound (the bus's): nobody classified, counted or logged it yet."""

    def __init__(self, platform: str, site: str, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(platform, site, message, retryable=True, retry_after=retry_after)


# The note of the bound this task's platform calls run under (see :func:`within`); None outside one.
CALL_NOTE: contextvars.ContextVar[CallNote | None] = contextvars.ContextVar("kazma_call_note", default=None)


def begun(platform: str, site: str) -> None:
    """A platform call starts under the current bound: the note is its own from now (an earlier call's is done)."""
    note = CALL_NOTE.get()
    if note is not None:
        note.platform, note.site, note.phase = platform, site, "sent"
        note.answer = note.retry_after = None


def moved(phase: Phase) -> None:
    """The call under the current bound waits for its chat's turn (``turn``) or sends its request (``sent``)."""
    note = CALL_NOTE.get()
    if note is not None:
        note.phase = phase


def answered(what: str, retry_after: float | None = None, *, kept: bool = False) -> None:
    """The call under the current bound was answered with a failure (``what``: who answered what, e.g. "Slack
    answered ratelimited") and may be tried again (after ``retry_after`` seconds, a 429's). ``kept``: an account
    from afar (the kit's, of the failure its call raised), which leaves one the dialect noted since the request
    went out (what its library saw on the wire, said more exactly)."""
    note = CALL_NOTE.get()
    if note is None or (kept and note.phase == "retry" and note.answer is not None):
        return
    note.phase, note.answer, note.retry_after = "retry", what, retry_after
    note.answered_at = time.monotonic()


def wording(error: PlatformError) -> str:
    """``error``'s own words, without the ``platform site:`` its text starts with."""
    return str(error).removeprefix(f"{error.platform} {error.site}: ")


async def within(awaitable: Awaitable[T], seconds: float, *, platform: str, site: str) -> T:
    """``await awaitable`` (platform calls on ``platform``), bounded by ``seconds``; when the bound runs out, a
    :class:`CutShort` saying what the call was doing instead of :class:`TimeoutError`."""
    note = CallNote()
    token = CALL_NOTE.set(note)
    try:
        async with asyncio.timeout(seconds) as bound:
            return await awaitable
    except TimeoutError as exc:
        if not bound.expired():
            raise  # not this bound's: the call's own, classified (or not) by whoever raised it
        raise note.told(platform, site, seconds, time.monotonic()) from exc
    finally:
        CALL_NOTE.reset(token)
