"""Named failpoints: one fault at one durable boundary, on purpose, for the chaos matrix (``tests/chaos``).

``KAZMA_FAILPOINTS="name=action[,name=action…]"`` is read once, when this module is first imported (as
``kazma run`` starts). Each action fires at the first time its point is reached, then the point is spent
(``N*action``: the first N times). ``name@where`` fires only where a site says it is ``where`` (a platform:
``bus.post@telegram``), so one run can put its fault on one platform of several. The actions:

- ``crash``: the process dies there and then — ``SIGKILL`` to itself, nothing flushed, nothing cleaned up;
- ``error``: the point raises the error its real failure raises there (each call site says which: the
  store's own error type, the platform's, the swarm store's …);
- ``hang``: it never returns (an ``await`` that never ends, or a blocked thread where the point is synchronous);
- ``delay:<ms>``: it returns after that many milliseconds.

With the variable unset, a call site costs one attribute check (``if failpoints.armed:``), measured in
``bench/failpoints_cost.py``. A name that is not in :data:`POINTS` is a mistake, refused at start
(:func:`check`), never ignored: a typo would otherwise pass a chaos cell that injected nothing.

Every point that fires says so first, on stderr, as one JSON line (``failpoint.fired``): written with
``os.write`` before the action, so the line is there even when the action is ``crash``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from kazma.config.registry import CHAT_PLATFORMS

ENV: Final = "KAZMA_FAILPOINTS"

# Every named point, grouped by the boundary it sits at. ``tests/chaos/matrix.py`` pins an ending for each
# point × action × store, and a test checks that every name here has a call site and a row there.
POINTS: Final = frozenset(
    {
        # opening a request: its row and card posts (one transaction), each post, recording each message id
        "approvals.open.row",
        "approvals.open.card_job",
        "approvals.open.committed",
        "bus.post",
        "bus.post.recorded",
        # deciding: before and after the compare-and-set commits, and before the presser is answered
        "approvals.decide.before_commit",
        "approvals.decide.after_commit",
        "approvals.decide.before_answer",
        # settling: the edit sent, the edit recorded
        "bus.settle.sent",
        "bus.settle.recorded",
        # executing a tool: its approval verified, the execution started and finished, its result recorded
        "tools.verified",
        "tools.started",
        "tools.finished",
        "tools.recorded",
        # plan steps
        "plan.dispatch",
        "plan.complete",
        "plan.repair",
        "plan.question.asked",
        "plan.question.answered",
        # swarm tasks
        "swarm.admitted",
        "swarm.step.started",
        "swarm.step.finished",
        "swarm.checkpoint.card",
        "swarm.checkpoint.paused",
        "swarm.resumed",
        "swarm.handoff",
        "swarm.result.stored",
        # an MCP server's tool call
        "mcp.call",
        # the approvals API's idempotent open
        "api.open",
        # among replicas: an inbound event's claim, the leader taking over
        "inbound.claim",
        "leader.takeover",
        # a platform's own points (Telegram's webhook inbox), named by its registry entry
        *(point for spec in CHAT_PLATFORMS.values() for point in spec.failpoints),
    }
)

ACTIONS: Final = ("crash", "error", "hang", "delay")


class FailpointError(RuntimeError):
    """The error of a point whose call site names none (every site in Kazma names its own)."""


class FailpointSpecError(ValueError):
    """``KAZMA_FAILPOINTS`` does not parse, or names a point that does not exist."""


@dataclass
class Armed:
    action: str  # crash | error | hang | delay
    where: str | None = None  # only where the site says it is (``@where``); None: anywhere
    delay_ms: int = 0
    times: int = 1  # how many more times it fires

    def describe(self) -> str:
        return f"delay:{self.delay_ms}" if self.action == "delay" else self.action


def parse(spec: str) -> dict[str, Armed]:
    """``name=[N*]action,…`` → armed points; :class:`FailpointSpecError` with what is wrong, in words."""
    armed: dict[str, Armed] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, sep, action = (s.strip() for s in part.partition("="))
        if not sep or not name or not action:
            raise FailpointSpecError(f"{ENV}: {part!r} is not name=action")
        name, at, where = name.partition("@")
        if at and not where:
            raise FailpointSpecError(f"{ENV}: {part!r}: say where after '@', as bus.post@web")
        if name not in POINTS:
            raise FailpointSpecError(f"{ENV}: no failpoint named {name!r} (known: {', '.join(sorted(POINTS))})")
        times = 1
        count, star, rest = action.partition("*")
        if star:
            if not count.isdigit() or int(count) < 1:
                raise FailpointSpecError(f"{ENV}: {part!r}: the count before '*' must be a positive number")
            times, action = int(count), rest.strip()
        kind, _, argument = action.partition(":")
        if kind not in ACTIONS:
            raise FailpointSpecError(f"{ENV}: {part!r}: the action must be one of {', '.join(ACTIONS)} (delay:<ms>)")
        delay = 0
        if kind == "delay":
            if not argument.isdigit():
                raise FailpointSpecError(f"{ENV}: {part!r}: delay needs milliseconds, as delay:250")
            delay = int(argument)
        elif argument:
            raise FailpointSpecError(f"{ENV}: {part!r}: {kind} takes no argument")
        armed[name] = Armed(kind, where or None, delay, times)
    return armed


def _load() -> tuple[dict[str, Armed], str | None]:
    spec = os.environ.get(ENV, "")
    if not spec.strip():
        return {}, None
    try:
        return parse(spec), None
    except FailpointSpecError as exc:
        return {}, str(exc)


_points, problem = _load()
# The one check every call site makes: False unless KAZMA_FAILPOINTS armed at least one point.
armed: bool = bool(_points)
_lock = threading.Lock()


def check() -> list[str]:
    """At start: the armed points (``name=action``), or :class:`FailpointSpecError` when the variable is wrong."""
    if problem is not None:
        raise FailpointSpecError(problem)
    return [f"{name}{_at(point)}={point.describe()}" for name, point in sorted(_points.items())]


def _at(point: Armed) -> str:
    return "" if point.where is None else f"@{point.where}"


def _take(name: str, where: str | None) -> Armed | None:
    """The point's action if it fires now (spending one of its times), else None."""
    with _lock:
        point = _points.get(name)
        if point is None or point.times <= 0 or (point.where is not None and point.where != where):
            return None
        point.times -= 1
        return point


def _say(name: str, point: Armed, where: str | None) -> None:
    said = {"event": "failpoint.fired", "level": "warning", "failpoint": name, "action": point.describe()}
    line = json.dumps({**said, "where": where} if where else said)
    os.write(2, (line + "\n").encode())


def _crash() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(137)  # only if the signal were blocked


def _error(name: str, error: Callable[[], BaseException] | None) -> BaseException:
    return error() if error is not None else FailpointError(f"failpoint {name}")


async def reached(name: str, error: Callable[[], BaseException] | None = None, *, where: str | None = None) -> None:
    """An ``async`` boundary reached: fire its armed action, if any. Call only ``if failpoints.armed``.

    ``error`` makes the exception the real failure raises here; ``where`` says which of several (a platform)."""
    point = _take(name, where)
    if point is None:
        return
    _say(name, point, where)
    if point.action == "crash":
        _crash()
    elif point.action == "error":
        raise _error(name, error)
    elif point.action == "hang":
        await asyncio.Event().wait()
    else:
        await asyncio.sleep(point.delay_ms / 1000)


def reached_sync(name: str, error: Callable[[], BaseException] | None = None, *, where: str | None = None) -> None:
    """A synchronous boundary reached (inside a store transaction): fire its armed action, if any."""
    point = _take(name, where)
    if point is None:
        return
    _say(name, point, where)
    if point.action == "crash":
        _crash()
    elif point.action == "error":
        raise _error(name, error)
    elif point.action == "hang":
        threading.Event().wait()
    else:
        time.sleep(point.delay_ms / 1000)


def arm_for_test(spec: str) -> None:
    """Arm points in this process (tests of the module itself; processes under test use the variable)."""
    global armed, _points, problem
    _points, problem = parse(spec), None
    armed = bool(_points)


def disarm() -> None:
    global armed, _points, problem
    _points, problem, armed = {}, None, False
