"""Waiting with a bound without losing a cancel: for an :class:`asyncio.Event`, and for any awaitable.

On Python 3.11, ``asyncio.wait_for(event.wait(), t)`` returns normally when the event is set in the same turn
of the loop as the waiting task is cancelled: the cancel is dropped. A loop that waits this way (a worker asleep
until kicked, a poller between reads) then goes round again, and a stop that cancelled it waits for it for good
— the hang once seen at ``kazma run``'s stop. The same holds for any awaitable that finishes in the turn its
waiter is cancelled: an audit sink cancelled as its delivery was answered went on delivering, and the stop that
cancelled it waited for good. ``asyncio.timeout`` keeps the cancel; every bounded wait goes through here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


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


async def bounded(awaitable: Awaitable[T], seconds: float | None) -> T:
    """``await awaitable``, or :class:`TimeoutError` after ``seconds`` (None: no bound); ``asyncio.wait_for``
    without its dropped cancel (see the module's docstring)."""
    async with asyncio.timeout(seconds):
        return await awaitable
