"""The one press policy every platform follows, and its wording.

The platform acknowledges a press itself (each has its own deadline for that) and then hands it to
:meth:`PressPolicy.press`: the press is claimed across replicas, decided, and answered — a quiet
acknowledgement to the winner (the edited card is the public record), a private notice to a loser or a
refused presser, and one apology that never shows exception text when the press could not be recorded.
A decision slower than ``press_timeout`` is answered "recorded, updating" and goes on; its outcome still
reaches the presser. A decision cut off midway (the process stopped past its grace) looks in the store: a press
that did not commit (or that nobody can check) is told so, and asked to press again.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ClassVar, Final, Protocol, TypeVar

import structlog

from kazma.adapters.contract import Handlers, PlatformError, Press
from kazma.approvals.model import PressResult, PressVerdict
from kazma.config.metrics import count_failure
from kazma.config.waits import bounded

log = structlog.get_logger("kazma.adapters")

T = TypeVar("T")

PRESS_APOLOGY: Final = "Kazma could not record your press, so nothing changed. Please press again."
PRESS_PENDING: Final = "Recorded, updating…"
# A decision cancelled midway (Kazma stopped) whose press is not on the record, or nobody could check it.
PRESS_CUT_OFF: Final = "Kazma stopped before your press was recorded, so nothing changed. Please press again."
PRESS_INACTIVE: Final = "This button is not active right now; nothing was recorded."
# A press whose data is not a button of the message it came from (a modified client; a card edited meanwhile).
PRESS_NOT_ON_MESSAGE: Final = "That button is no longer on this message, so nothing was recorded."
NOT_YOURS: Final = "You are not an approver for this request, so there is nothing to give a reason for."


class PressReply(Protocol):
    """How a platform answers the person who pressed (the press itself was acknowledged already)."""

    async def acknowledge(self, text: str) -> None:
        """Quietly, to the presser: their press decided the request (the card edit is the public record)."""
        ...

    async def notify(self, text: str) -> None:
        """Privately and prominently: the press lost, was refused, or could not be recorded."""
        ...


class PressPolicy(ABC):
    """The press half of :class:`~kazma.adapters.kit.PlatformBase` (which supplies what is declared here)."""

    name: ClassVar[str]
    press_timeout: float
    stop_grace: float  # how long a stop lets work finish, and then waits for what it cancelled
    _handlers: Handlers | None

    @abstractmethod
    def spawn(self, work: Coroutine[Any, Any, T], *, name: str, awaited: bool = False) -> asyncio.Task[T]:
        """Run ``work`` as tracked work (drained on stop); ``awaited``: its failure is the caller's to handle."""

    @abstractmethod
    async def _claim(self, key: str | None, kept: str | None = None) -> bool:
        """Whether this replica handles the event ``key``."""

    @abstractmethod
    async def _taken_in(self, key: str | None) -> bool:
        """Record that the event ``key`` is taken in here (False: its claim is another replica's now)."""

    @abstractmethod
    async def _first_in_store(self, keys: list[str]) -> bool:
        """Whether the store had never seen these keys of one signed request (each is recorded now)."""

    @abstractmethod
    def classify(self, site: str, exc: BaseException) -> PlatformError:
        """The platform's failure as a :class:`PlatformError`."""

    async def press(self, press: Press, reply: PressReply, *, key: str | None = None) -> None:
        """The one press policy. The platform acknowledged the press itself before calling this. ``key``: the
        platform's id of the press, claimed across replicas; a press another replica claimed gets no answer
        here (that replica answers it)."""
        handlers = self._handlers
        log.info("platform.press", platform=self.name, actor=press.actor, chat=press.chat, data=press.data[:80])
        if handlers is None or not press.data:
            if press.signed and not await self._first_in_store(list(press.signed)):
                self._replayed(press)
                return
            await self._reply(reply.notify, PRESS_INACTIVE)
            return
        if not await self._claim(key):
            return
        decision = self.spawn(self._decide(handlers, press, key, reply), name=f"{self.name}-press", awaited=True)
        try:
            # Shielded: a slow decision keeps running after we answer; only our wait ends.
            result = await bounded(asyncio.shield(decision), self.press_timeout)
        except TimeoutError:
            log.info("platform.press_pending", platform=self.name, actor=press.actor)
            await self._reply(reply.acknowledge, PRESS_PENDING)
            decision.add_done_callback(lambda done: self.spawn(self._late(done, press, reply), name="press-late"))
            return
        except Exception:
            count_failure("press", self.name)
            log.exception("platform.press_failed", platform=self.name, actor=press.actor)
            await self._reply(reply.notify, PRESS_APOLOGY)
            return
        await self._answer(result, press, reply)

    async def _decide(self, handlers: Handlers, press: Press, key: str | None, reply: PressReply) -> PressResult:
        """The decision, then the press is taken in (a replica dying before that leaves it to another)."""
        try:
            result = await handlers.on_press(press)
            await self._taken_in(key)
        except asyncio.CancelledError:
            # Here, not in _late: a stop cancels what a cancelled task starts, so a notice spawned then never ran.
            await self._cut_off(handlers, press, reply)
            raise
        return result

    async def _cut_off(self, handlers: Handlers, press: Press, reply: PressReply) -> None:
        """The decision of ``press`` was cancelled (a stop past its grace): its presser may have been told
        "Recorded, updating…", or nothing yet. The store says whether it committed; when it did not, or cannot
        say, the presser is told it was not recorded. The stop does not cancel this task again, and waits for it
        up to its patience; a notice that cannot be sent any more is counted by :meth:`_reply`."""
        recorded: bool | None = None
        if handlers.press_recorded is not None:
            try:
                # Half the stop's patience at most: the notice needs the rest before the platform closes.
                within = min(self.press_timeout, self.stop_grace / 2)
                recorded = await bounded(handlers.press_recorded(press), within)
            except Exception as exc:
                log.warning("platform.press_check_failed", platform=self.name, actor=press.actor, error=repr(exc))
        if recorded:
            log.info("platform.press_cut_off", platform=self.name, actor=press.actor, recorded=True)
            return
        count_failure("press_cut_off", self.name)
        log.warning("platform.press_cut_off", platform=self.name, actor=press.actor, recorded=recorded)
        await self._reply(reply.notify, PRESS_CUT_OFF)

    async def _late(self, decision: asyncio.Future[PressResult], press: Press, reply: PressReply) -> None:
        if decision.cancelled():  # its presser was told how it ended by _cut_off
            return
        error = decision.exception()
        if error is not None:
            count_failure("press", self.name)
            log.error("platform.press_failed", platform=self.name, actor=press.actor, error=repr(error))
            await self._reply(reply.notify, PRESS_APOLOGY)
            return
        await self._answer(decision.result(), press, reply)

    async def _answer(self, result: PressResult, press: Press, reply: PressReply) -> None:
        log.info(
            "platform.press_result",
            platform=self.name,
            actor=press.actor,
            verdict=result.verdict.value,
            request_id=result.request_id,
        )
        if result.verdict is PressVerdict.REPLAYED:
            self._replayed(press)
        elif result.verdict is PressVerdict.WON:
            await self._reply(reply.acknowledge, result.message)
        else:
            await self._reply(reply.notify, result.message)

    def _replayed(self, press: Press) -> None:
        """The signed request that carried ``press`` was seen before (the store said so): nothing ran, nobody is
        told; counted, as evidence of an attack or a retry storm."""
        count_failure("replay_dropped", self.name)
        log.warning("platform.replay_dropped", platform=self.name, keys=[k.split(":", 1)[0] for k in press.signed])

    async def _reply(self, say: Callable[[str], Awaitable[None]], text: str) -> None:
        try:
            await say(text)
        except Exception as exc:
            # A platform's call counted its own failure (the kit's failed()): counted here too, one reply that
            # did not go out read as two.
            if not (isinstance(exc, PlatformError) and exc.counted):
                count_failure("press_reply", self.name)
            error = exc if isinstance(exc, PlatformError) else self.classify("press_reply", exc)
            log.warning("platform.press_reply_failed", platform=self.name, error=str(error))
