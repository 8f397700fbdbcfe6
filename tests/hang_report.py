"""Where a hung test waits: shortly before pytest-timeout ends a test, every task of the event loop the test runs
on prints its stack.

pytest-timeout dumps the threads' stacks, and for an asyncio test the main thread's is only the loop idling in
``select``: it shows that the test hangs, not on which ``await``. This plugin starts a timer thread per test; if
the test is still running some seconds before its timeout, the timer finds the loop in the main thread's frames
and prints each of its tasks' stacks to stderr (pytest's own capture is bypassed: a timeout ends the process
before the captured output would be shown).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Generator
from types import FrameType

import pytest

AHEAD_SECONDS = 15.0  # printed this long before pytest-timeout fires (a quarter of the time, for short ones)


def _timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    value = item.config.getoption("timeout", None)
    if value is None:
        value = item.config.getini("timeout")
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


def _loop_in(frame: FrameType | None) -> asyncio.AbstractEventLoop | None:
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, asyncio.AbstractEventLoop):
            return candidate
        frame = frame.f_back
    return None


def awaits(task: asyncio.Task[object]) -> list[str]:
    """The chain of awaits a suspended task is in, outermost first (``Task.print_stack`` shows only the task's
    own coroutine's frame, not the coroutines it awaits)."""
    lines: list[str] = []
    step: object = task.get_coro()
    while step is not None:
        frame = getattr(step, "cr_frame", None) or getattr(step, "gi_frame", None) or getattr(step, "ag_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        else:
            lines.append(f"  (awaiting {step!r})")
        step = getattr(step, "cr_await", None) or getattr(step, "gi_yieldfrom", None) or getattr(step, "ag_await", None)
    return lines


def _report(nodeid: str, main_ident: int) -> None:
    out = sys.__stderr__
    if out is None:
        return
    loop = _loop_in(sys._current_frames().get(main_ident))
    print(f"\n== hang report: {nodeid} is still running; its event loop's tasks:", file=out)
    if loop is None:
        print("   (no event loop running in the main thread)", file=out)
        return
    # Read from this thread while the loop idles in select (a hang): good enough for a diagnosis.
    for task in list(asyncio.all_tasks(loop)):
        print(f"-- {task!r}", file=out)
        print("\n".join(awaits(task)), file=out)
    out.flush()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    timeout = _timeout_of(item)
    seconds = timeout - min(AHEAD_SECONDS, timeout / 4)
    timer = None
    if seconds > 0:
        timer = threading.Timer(seconds, _report, args=(item.nodeid, threading.main_thread().ident or 0))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
