"""The approvals API's long-polls in this process: one wait per request for all of them, one answer for all.

Every ``GET /api/v1/approvals/{id}?wait=`` of one request shares a single wait on the approvals service (one
task, :meth:`ApprovalService.wait_request`). When the request ends, that task describes it once (the check
that an approval is one Kazma would run reads the store) and only then answers every long-poll, each in one
step of its own task: the bytes are ready before any of them runs. Woken one by one through the service, 500
long-polls of one request each took several steps before the one read of the approval could even start, and
the last answer went out 25-55 ms after the decision's commit (the goal is 30 ms).

Each long-poll keeps its own ``?wait=`` (a :func:`asyncio.timeout` around its own future: one giving up takes
nothing from the others) and the web server's stop answers all of them at once (:meth:`LongPolls.stop` brings
every timeout forward). The shared wait ends when its last long-poll leaves; it never withdraws the request
(``cancel_with_waiter=False``: a client that stops polling decides nothing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from kazma.approvals.model import ApprovalRequest
from kazma.approvals.service import ApprovalService

Describe = Callable[[ApprovalRequest], Awaitable[bytes]]


class _Polled:
    """The long-polls of one request and the one wait that answers them."""

    def __init__(self) -> None:
        self.polls: set[asyncio.Future[bytes]] = set()
        self.wait: asyncio.Task[None] | None = None


class LongPolls:
    def __init__(self, service: ApprovalService, describe: Describe) -> None:
        self.service = service
        self.describe = describe  # the ended request's answer body, the same for every long-poll of it
        self.stopping = False
        self._polled: dict[str, _Polled] = {}
        self._cuts: set[asyncio.Timeout] = set()

    def polling(self, request_id: str | None = None) -> int:
        """How many long-polls of ``request_id`` (None: of any request) are open here."""
        if request_id is None:
            return sum(len(polled.polls) for polled in self._polled.values())
        polled = self._polled.get(request_id)
        return 0 if polled is None else len(polled.polls)

    async def answer_within(self, request_id: str, wait: float) -> bytes:
        """The answer's body once ``request_id`` ended; TimeoutError after ``wait`` seconds, or as soon as the web
        server stops (the poller is answered with what is known now and asks again, rather than held until the
        shutdown timeout and then cut off without an answer). What the shared wait raised, raised here."""
        if self.stopping:
            raise TimeoutError(f"the web server stops before {request_id} ended")
        polled = self._polled.get(request_id)
        if polled is None:
            polled = self._polled[request_id] = _Polled()
        mine: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        polled.polls.add(mine)
        if polled.wait is None:
            polled.wait = asyncio.ensure_future(self._wait(request_id, polled))
        try:
            async with asyncio.timeout(wait) as cut:
                self._cuts.add(cut)
                try:
                    return await mine
                finally:
                    self._cuts.discard(cut)
        finally:
            polled.polls.discard(mine)
            if not polled.polls and self._polled.get(request_id) is polled:
                del self._polled[request_id]
                if polled.wait is not None and not polled.wait.done():
                    polled.wait.cancel()  # nobody polls: nobody waits (the request is left as it is)

    def stop(self) -> None:
        """The web server shuts down: every open long-poll is answered now (with what is known) and ends."""
        self.stopping = True
        now = asyncio.get_running_loop().time()
        for cut in self._cuts:
            # One whose own ?wait= ran out this very turn is answering already: rescheduling it raised RuntimeError
            # out of the shutdown, and every long-poll after it in the set was left to its own ?wait=.
            if not cut.expired():
                cut.reschedule(now)

    async def _wait(self, request_id: str, polled: _Polled) -> None:
        try:
            ended = await self.service.wait_request(request_id, cancel_with_waiter=False)
            body = await self.describe(ended)
        except asyncio.CancelledError:
            raise  # only when its last long-poll left (or the loop ends): nobody to answer
        except Exception as exc:  # every long-poll of it answers with the error, as its own wait would have
            self._ended(request_id, polled)
            for poll in polled.polls:
                if not poll.done():
                    poll.set_exception(exc)
                    poll.exception()  # retrieved: a long-poll cancelled as it was set must not log it unheard
            return
        self._ended(request_id, polled)
        for poll in polled.polls:
            if not poll.done():
                poll.set_result(body)

    def _ended(self, request_id: str, polled: _Polled) -> None:
        # A long-poll arriving from now on finds the request ended (its own read) or starts a new wait
        if self._polled.get(request_id) is polled:
            del self._polled[request_id]
