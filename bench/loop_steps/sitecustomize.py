"""Every event-loop callback of a `kazma run` child, timed: bench/settle_blackbox.py ``--timeline`` puts this folder
on the child's PYTHONPATH and names a file in ``KAZMA_LOOP_STEPS``; the child writes one line per callback of
30 µs or more (``time.time()`` it began, wall ms, the thread's CPU ms, and what ran: a task by its coroutines'
chain, outermost and innermost, where it is suspended after the step) when it exits.

It wraps ``asyncio.events.Handle._run`` (the pure-Python hook every callback of the loop goes through): about
2 µs a callback, so the timeline is of a slightly slower child. A process without the variable is not touched.
"""

from __future__ import annotations

import asyncio
import asyncio.events
import atexit
import gc
import os
import time
from typing import Any

_FILE = os.environ.get("KAZMA_LOOP_STEPS")
_SHORTEST = 0.00003  # seconds: shorter callbacks are not written
_steps: list[tuple[float, float, float, str]] = []


def _named(callback: Any) -> str:
    """What ran: a task by its chain of coroutines (as suspended after the step), else the callback's name."""
    task = getattr(callback, "__self__", None)
    if type(callback).__name__ in ("TaskStepMethWrapper", "TaskWakeupMethWrapper"):
        # The C task's step wrappers do not expose their task; the garbage collector's view of them does.
        task = next((ref for ref in gc.get_referents(callback) if isinstance(ref, asyncio.Future)), None)
    get_coro = getattr(task, "get_coro", None)
    if get_coro is None:
        return str(getattr(callback, "__qualname__", type(callback).__name__))
    chain: list[str] = []
    inner = get_coro()
    while inner is not None and len(chain) < 16:
        chain.append(str(getattr(inner, "__qualname__", type(inner).__name__)))
        inner = getattr(inner, "cr_await", None) or getattr(inner, "gi_yieldfrom", None)
    shown = chain if len(chain) <= 4 else [*chain[:2], "...", *chain[-2:]]
    return "task " + " > ".join(shown)


def _install(path: str) -> None:
    run = asyncio.events.Handle._run

    def timed(handle: asyncio.events.Handle) -> None:
        began, wall, cpu = time.time(), time.perf_counter(), time.thread_time()
        run(handle)
        spent = time.perf_counter() - wall
        if spent >= _SHORTEST:  # named now: a task by where it waits after this step
            cpu = time.thread_time() - cpu
            _steps.append((began, spent, cpu, _named(handle._callback)))  # type: ignore[attr-defined]

    asyncio.events.Handle._run = timed  # type: ignore[method-assign, assignment]

    @atexit.register
    def write() -> None:
        with open(path, "w", encoding="utf-8") as out:
            for began, spent, cpu, name in _steps:
                out.write(f"{began:.6f} {spent * 1e3:.3f} {cpu * 1e3:.3f} {name}\n")


if _FILE:
    _install(_FILE)
