"""Waiting for an :class:`asyncio.Event` with a bound, without losing a cancel.

On Python 3.11, ``asyncio.wait_for(event.wait(), t)`` returns normally when the event is set in the same turn
of the loop as the waiting task is cancelled: the cancel is dropped. A loop that waits this way (a worker asleep
until kicked, a poller between reads) then goes round again, and a stop that cancelled it waits for it for good
— the hang once seen at ``kazma run``'s stop. ``asyncio.timeout`` keeps the cancel; every bounded wait for an
event goes through here.
"""

from __future__ import annotations

import asyncio


async def until_set(event: asyncio.Event, seconds: float | None) -> bool:
    """Wait until ``event`` is set or ``seconds`` have passed (None: no bound); whether it is set."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True
