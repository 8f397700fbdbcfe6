"""Breakers, retries, timeouts, output validation, fallback chains and concurrency limits."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from kazma.engine.fence import fence_untrusted
from kazma.engine.swarm.calls import CallLimits
from kazma.engine.swarm.reliability import (
    BreakerState,
    CircuitBreaker,
    OutputValidator,
    RetryPolicy,
    Ticket,
    classify_error,
    run_with_fallback,
    with_timeout,
)
from kazma.engine.swarm.types import ErrorKind, WorkerResult
from kazma.engine.types import ModelError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Sleeps:
    """Records every backoff instead of waiting."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


# -- circuit breaker: plain cases -------------------------------------------------------------


def state_of(breaker: CircuitBreaker) -> BreakerState:
    """Read the state afresh (mypy would otherwise keep an earlier assert's narrowing)."""
    return breaker.state


def test_consecutive_failures_open_the_breaker_and_a_success_resets_the_count() -> None:
    clock = Clock()
    breaker = CircuitBreaker("builder", failure_threshold=3, cooldown=30.0, clock=clock)
    for ok in (False, False, True, False, False):
        ticket = breaker.admit()
        assert ticket is not None
        assert breaker.record(ticket, ok)
    assert state_of(breaker) is BreakerState.CLOSED
    ticket = breaker.admit()
    assert ticket is not None
    breaker.record(ticket, False)
    assert state_of(breaker) is BreakerState.OPEN
    assert breaker.admit() is None
    assert breaker.retry_in() == 30.0
    clock.now += 12
    assert breaker.retry_in() == 18.0
    assert breaker.admit() is None


def test_after_cooldown_exactly_one_probe_runs_and_its_success_closes() -> None:
    clock = Clock()
    breaker = CircuitBreaker("builder", failure_threshold=1, cooldown=30.0, clock=clock)
    first = breaker.admit()
    assert first is not None
    breaker.record(first, False)
    opened_generation = breaker.generation
    clock.now += 30
    probe = breaker.admit()
    assert probe is not None
    assert probe.probe
    assert state_of(breaker) is BreakerState.HALF_OPEN
    assert [breaker.admit() for _ in range(5)] == [None] * 5
    assert breaker.record(probe, True)
    assert state_of(breaker) is BreakerState.CLOSED
    assert breaker.generation > opened_generation
    assert breaker.retry_in() == 0.0
    again = breaker.admit()
    assert again is not None
    assert not again.probe


def test_a_failed_probe_reopens_and_restarts_the_cooldown() -> None:
    clock = Clock()
    breaker = CircuitBreaker("builder", failure_threshold=1, cooldown=30.0, clock=clock)
    ticket = breaker.admit()
    assert ticket is not None
    breaker.record(ticket, False)
    clock.now += 45
    probe = breaker.admit()
    assert probe is not None
    breaker.record(probe, False)
    assert state_of(breaker) is BreakerState.OPEN
    assert breaker.retry_in() == 30.0
    clock.now += 29
    assert breaker.admit() is None
    clock.now += 1
    assert breaker.admit() is not None


def test_a_slow_success_from_before_opening_does_not_close_the_breaker() -> None:
    breaker = CircuitBreaker("builder", failure_threshold=2, cooldown=30.0, clock=Clock())
    slow = breaker.admit()
    a, b = breaker.admit(), breaker.admit()
    assert slow is not None
    assert a is not None
    assert b is not None
    breaker.record(a, False)
    breaker.record(b, False)
    assert state_of(breaker) is BreakerState.OPEN
    generation = breaker.generation
    assert not breaker.record(slow, True)
    assert state_of(breaker) is BreakerState.OPEN
    assert breaker.generation == generation


def test_a_probe_that_never_reports_loses_its_lease() -> None:
    clock = Clock()
    breaker = CircuitBreaker("builder", failure_threshold=1, cooldown=30.0, clock=clock)
    ticket = breaker.admit()
    assert ticket is not None
    breaker.record(ticket, False)
    clock.now += 30
    lost = breaker.admit()
    assert lost is not None
    clock.now += 29
    assert breaker.admit() is None
    clock.now += 1
    replacement = breaker.admit()
    assert replacement is not None
    assert replacement.probe
    assert not breaker.record(lost, True)  # stale: the breaker stays half-open for the new probe
    assert state_of(breaker) is BreakerState.HALF_OPEN
    assert breaker.record(replacement, True)
    assert state_of(breaker) is BreakerState.CLOSED


# -- circuit breaker: properties ---------------------------------------------------------------

OPERATIONS = st.lists(
    st.one_of(
        st.just(("admit", 0, 0.0)),
        st.tuples(st.just("ok"), st.integers(0, 50), st.just(0.0)),
        st.tuples(st.just("fail"), st.integers(0, 50), st.just(0.0)),
        st.tuples(st.just("advance"), st.just(0), st.floats(0.0, 40.0)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPERATIONS, threshold=st.integers(1, 4), cooldown=st.floats(1.0, 30.0))
def test_random_operations_never_give_two_live_probes_and_stale_outcomes_change_nothing(
    ops: list[tuple[str, int, float]], threshold: int, cooldown: float
) -> None:
    clock = Clock()
    breaker = CircuitBreaker("w", failure_threshold=threshold, cooldown=cooldown, clock=clock)
    outstanding: list[Ticket] = []  # handed out, not yet reported
    for op, pick, dt in ops:
        if op == "advance":
            clock.now += dt
        elif op == "admit":
            state_before = breaker.state
            ticket = breaker.admit()
            if state_before is BreakerState.CLOSED:
                assert ticket is not None
                assert not ticket.probe
            if ticket is not None:
                assert ticket.generation == breaker.generation
                outstanding.append(ticket)
        elif outstanding:
            ticket = outstanding.pop(pick % len(outstanding))
            before = (breaker.state, breaker.generation, breaker.failures)
            applied = breaker.record(ticket, op == "ok")
            if ticket.generation != before[1]:
                assert not applied
                assert (breaker.state, breaker.generation, breaker.failures) == before
            else:
                assert applied
        live_probes = [t for t in outstanding if t.probe and t.generation == breaker.generation]
        assert len(live_probes) <= 1
        if live_probes or breaker.state is BreakerState.OPEN:
            assert all(not (t.generation == breaker.generation and not t.probe) for t in outstanding)
        if breaker.state is BreakerState.CLOSED:
            assert breaker.failures < threshold


@settings(max_examples=300, deadline=None)
@given(ops=OPERATIONS, threshold=st.integers(1, 3))
def test_while_a_probe_is_out_and_its_lease_holds_nobody_else_is_admitted(
    ops: list[tuple[str, int, float]], threshold: int
) -> None:
    clock = Clock()
    breaker = CircuitBreaker("w", failure_threshold=threshold, cooldown=10.0, clock=clock)
    outstanding: list[Ticket] = []
    probe: tuple[Ticket, float] | None = None  # the probe handed out last, and when
    for op, pick, dt in ops:
        if op == "advance":
            clock.now += dt
        elif op == "admit":
            ticket = breaker.admit()
            if probe is not None and probe[0] in outstanding and clock.now - probe[1] < 10.0:
                assert ticket is None
            if ticket is not None:
                outstanding.append(ticket)
                if ticket.probe:
                    probe = (ticket, clock.now)
        elif outstanding:
            breaker.record(outstanding.pop(pick % len(outstanding)), op == "ok")


# -- error classification -------------------------------------------------------------------------


def _status_error(code: int, body: str = "") -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    return httpx.HTTPStatusError(
        body or f"HTTP {code}", request=request, response=httpx.Response(code, request=request)
    )


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        ("401 Unauthorized", ErrorKind.PERMANENT),
        ("Invalid API key provided", ErrorKind.PERMANENT),
        ("HTTP 403 forbidden", ErrorKind.PERMANENT),
        ("model not found", ErrorKind.PERMANENT),
        ("insufficient_quota", ErrorKind.PERMANENT),
        ("429: You exceeded your current quota", ErrorKind.PERMANENT),
        ("429 Too Many Requests", ErrorKind.TRANSIENT),
        ("502 Bad Gateway", ErrorKind.TRANSIENT),
        ("connection refused", ErrorKind.TRANSIENT),
        ("request timed out", ErrorKind.TIMEOUT),
        ("the answer was nonsense", ErrorKind.PERMANENT),
        (TimeoutError(), ErrorKind.TIMEOUT),
        (httpx.ReadTimeout("slow"), ErrorKind.TIMEOUT),
        (httpx.ConnectError("refused"), ErrorKind.TRANSIENT),
        (ConnectionResetError("reset"), ErrorKind.TRANSIENT),
        (_status_error(503), ErrorKind.TRANSIENT),
        (_status_error(401), ErrorKind.PERMANENT),
        (_status_error(404), ErrorKind.PERMANENT),
        (_status_error(429, "rate limited"), ErrorKind.TRANSIENT),
        (_status_error(429, "quota exceeded"), ErrorKind.PERMANENT),
        (ModelError("bad key", permanent=True, status=401), ErrorKind.PERMANENT),
        (ModelError("server hiccup", permanent=False), ErrorKind.TRANSIENT),
        (ValueError("bug"), ErrorKind.PERMANENT),
    ],
)
def test_classify_error(error: BaseException | str, kind: ErrorKind) -> None:
    assert classify_error(error) is kind


# -- retry policy -----------------------------------------------------------------------------------


class Script:
    """A call that plays back results (or raises exceptions) and counts how often it ran."""

    def __init__(self, *steps: WorkerResult | Exception) -> None:
        self.steps = list(steps)
        self.calls = 0

    async def __call__(self) -> WorkerResult:
        step = self.steps[min(self.calls, len(self.steps) - 1)]
        self.calls += 1
        if isinstance(step, Exception):
            raise step
        return step


def fail(kind: ErrorKind | None, error: str = "boom", *, changed: bool = False, worker: str = "w") -> WorkerResult:
    return WorkerResult(worker, False, error=error, error_kind=kind, changed_state=changed)


@pytest.mark.parametrize(
    "step",
    [
        fail(ErrorKind.PERMANENT, "invalid api key"),
        fail(None, "401 Unauthorized"),
        PermissionError("403 forbidden"),
        RuntimeError("insufficient_quota"),
    ],
)
async def test_permanent_errors_are_tried_once(step: WorkerResult | Exception) -> None:
    sleeps, script = Sleeps(), Script(step)
    result = await RetryPolicy(max_attempts=5, sleep=sleeps).run(script, worker="w")
    assert script.calls == 1
    assert not result.ok
    assert sleeps.delays == []


@pytest.mark.parametrize("ok", [True, False])
async def test_a_result_that_changed_state_is_never_retried(ok: bool) -> None:
    sleeps = Sleeps()
    changed = WorkerResult("w", ok, error="" if ok else "503 after writing", changed_state=True)
    script = Script(changed, WorkerResult("w", True, output="second"))
    result = await RetryPolicy(max_attempts=5, sleep=sleeps).run(script)
    assert script.calls == 1
    assert result is changed


async def test_transient_failures_are_retried_up_to_max_with_capped_jittered_backoff() -> None:
    sleeps, script = Sleeps(), Script(fail(ErrorKind.TRANSIENT), ConnectionError("refused"), fail(ErrorKind.TIMEOUT))
    rolls = iter([0.0, 1.0, 0.5, 0.0, 0.25])
    policy = RetryPolicy(max_attempts=6, base=1.0, cap=5.0, sleep=sleeps, rng=lambda: next(rolls))
    result = await policy.run(script, worker="w")
    assert script.calls == 6
    assert result.error_kind is ErrorKind.TIMEOUT
    ceilings = [1.0, 2.0, 4.0, 5.0, 5.0]
    assert sleeps.delays == [0.5, 2.0, 3.0, 2.5, 3.125]
    assert all(c / 2 <= d <= c <= 5.0 for d, c in zip(sleeps.delays, ceilings, strict=True))


async def test_without_jitter_the_delays_are_the_capped_exponential() -> None:
    sleeps, script = Sleeps(), Script(fail(ErrorKind.TRANSIENT))
    await RetryPolicy(max_attempts=5, base=0.5, cap=2.0, jitter=False, sleep=sleeps).run(script)
    assert sleeps.delays == [0.5, 1.0, 2.0, 2.0]


async def test_swarm_retry_is_logged_once_per_retry_not_after_the_last_attempt() -> None:
    # It was logged after the final attempt too, announcing a retry that never came.
    sleeps, script = Sleeps(), Script(fail(ErrorKind.TRANSIENT))
    with capture_logs() as events:
        await RetryPolicy(max_attempts=3, jitter=False, sleep=sleeps).run(script, worker="w")
    retries = [e["attempt"] for e in events if e["event"] == "swarm.retry"]
    assert (script.calls, len(sleeps.delays), retries) == (3, 2, [1, 2])


async def test_a_transient_failure_then_success_returns_the_success() -> None:
    sleeps, script = Sleeps(), Script(fail(None, "502 Bad Gateway"), WorkerResult("w", True, output="fine"))
    result = await RetryPolicy(sleep=sleeps).run(script)
    assert (result.ok, result.output, script.calls, len(sleeps.delays)) == (True, "fine", 2, 1)


async def test_with_timeout_turns_running_out_into_a_timeout_result() -> None:
    never = asyncio.Event()

    async def hangs() -> WorkerResult:
        await never.wait()
        return WorkerResult("w", True)

    result = await with_timeout(hangs, 0.01, worker="w")
    assert result == WorkerResult("w", False, error="timed out after 0.01 s", error_kind=ErrorKind.TIMEOUT)

    async def quick() -> WorkerResult:
        return WorkerResult("w", True, output="yes")

    assert (await with_timeout(quick, 5)).output == "yes"


async def test_a_calls_own_timeout_error_is_not_reported_as_ours() -> None:
    async def own() -> WorkerResult:
        raise TimeoutError("upstream read timeout")

    with pytest.raises(TimeoutError, match="upstream"):
        await with_timeout(own, 60)
    result = await RetryPolicy(max_attempts=1).run(lambda: with_timeout(own, 60), worker="w")
    assert (result.error_kind, result.error) == (ErrorKind.TIMEOUT, "TimeoutError: upstream read timeout")


# -- output validation --------------------------------------------------------------------------------


class Report(pydantic.BaseModel):
    title: str
    score: int


def test_pydantic_validator() -> None:
    validator = OutputValidator(Report)
    assert validator.validate('{"title": "t", "score": 3}') == (True, "")
    assert validator.validate('```json\n{"title": "t", "score": 3}\n```') == (True, "")
    ok, reason = validator.validate('{"title": "t"}')
    assert not ok
    assert "Report" in reason
    assert "score" in reason
    ok, reason = validator.validate("not json at all")
    assert not ok


SCHEMA = {
    "type": "object",
    "required": ["name", "tags"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 5},
        "level": {"type": "integer", "minimum": 1, "maximum": 3},
        "mode": {"enum": ["fast", "slow"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "note": {"type": ["string", "null"]},
    },
}


@pytest.mark.parametrize(
    ("output", "problem"),
    [
        ('{"name": "ann", "tags": [], "level": 2, "mode": "fast", "note": null}', None),
        ('{"name": "ann", "tags": ["a"], "level": 3.0}', None),
        ('{"tags": []}', "$: 'name' is a required property"),
        ('{"name": 5, "tags": []}', "$.name: 5 is not of type 'string'"),
        ('{"name": "", "tags": []}', "$.name: '' should be non-empty"),
        ('{"name": "annabel", "tags": []}', "$.name: 'annabel' is too long"),
        ('{"name": "ann", "tags": [], "level": 0}', "$.level: 0 is less than the minimum of 1"),
        ('{"name": "ann", "tags": [], "level": 4}', "$.level: 4 is greater than the maximum of 3"),
        ('{"name": "ann", "tags": [], "level": true}', "$.level: True is not of type 'integer'"),
        ('{"name": "ann", "tags": [], "mode": "medium"}', "$.mode: 'medium' is not one of ['fast', 'slow']"),
        ('{"name": "ann", "tags": [1]}', "$.tags[0]: 1 is not of type 'string'"),
        ('{"name": "ann", "tags": [], "extra": 1}', "Additional properties are not allowed ('extra' was unexpected)"),
        ('["name"]', "$: ['name'] is not of type 'object'"),
        ("{oops", "not JSON"),
    ],
)
def test_json_schema_validator(output: str, problem: str | None) -> None:
    ok, reason = OutputValidator(SCHEMA).validate(output)
    if problem is None:
        assert (ok, reason) == (True, "")
    else:
        assert not ok
        assert problem in reason


def test_every_keyword_of_the_schemas_draft_is_checked() -> None:
    """jsonschema, not a subset: pattern, oneOf, const, formats' neighbours all hold (the subset refused them)."""
    assert OutputValidator({"type": "string", "pattern": "^a"}).validate('"abc"') == (True, "")
    ok, reason = OutputValidator({"type": "string", "pattern": "^a"}).validate('"bcd"')
    assert (ok, reason) == (False, "output does not match the schema: $: 'bcd' does not match '^a'")
    one_of = {"type": "object", "properties": {"a": {"oneOf": [{"type": "integer"}, {"const": "none"}]}}}
    assert OutputValidator(one_of).validate('{"a": "none"}') == (True, "")
    assert OutputValidator(one_of).validate('{"a": 1}') == (True, "")
    assert not OutputValidator(one_of).validate('{"a": "some"}')[0]


def test_a_schema_that_is_not_valid_is_refused_when_it_is_given() -> None:
    with pytest.raises(ValueError, match=r"not a valid JSON schema at \$\.type: 'strin' is not valid"):
        OutputValidator({"type": "strin"})
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        OutputValidator({"type": "object", "properties": {"a": {"minLength": -1}}})


# -- fallback chain ------------------------------------------------------------------------------------


class FakeWorker:
    def __init__(self, name: str, *results: WorkerResult) -> None:
        self._name = name
        self.results = list(results)
        self.calls: list[tuple[str, str]] = []

    @property
    def name(self) -> str:
        return self._name

    @property
    def expertise(self) -> tuple[str, ...]:
        return ()

    async def run(self, prompt: str, *, context: str = "") -> WorkerResult:
        self.calls.append((prompt, context))
        return self.results[min(len(self.calls), len(self.results)) - 1]


def breakers_for(*names: str, clock: Callable[[], float] | None = None) -> dict[str, CircuitBreaker]:
    return {n: CircuitBreaker(n, failure_threshold=1, cooldown=60.0, clock=clock or Clock()) for n in names}


async def test_fallback_moves_on_after_transient_failures() -> None:
    first = FakeWorker("first", fail(ErrorKind.TRANSIENT, "503", worker="first"))
    second = FakeWorker("second", WorkerResult("second", True, output="answer"))
    breakers = breakers_for("first", "second")
    sleeps = Sleeps()
    context = fence_untrusted("ctx", source="an earlier stage")
    result = await run_with_fallback(
        [first, second],
        "q",
        context=context,
        breakers=breakers,
        policy=RetryPolicy(max_attempts=3, sleep=sleeps),
        timeout=5,
    )
    assert (result.worker, result.ok, result.output) == ("second", True, "answer")
    assert first.calls == [("q", context)] * 3
    assert second.calls == [("q", context)]
    assert len(sleeps.delays) == 2
    assert breakers["first"].state is BreakerState.OPEN
    assert breakers["second"].state is BreakerState.CLOSED


async def test_fallback_skips_a_worker_whose_breaker_is_open() -> None:
    first = FakeWorker("first", WorkerResult("first", True, output="should not run"))
    second = FakeWorker("second", WorkerResult("second", True, output="answer"))
    breakers = breakers_for("first", "second")
    ticket = breakers["first"].admit()
    assert ticket is not None
    breakers["first"].record(ticket, False)
    result = await run_with_fallback(
        [first, second], "q", breakers=breakers, policy=RetryPolicy(sleep=Sleeps()), timeout=5
    )
    assert result.output == "answer"
    assert first.calls == []


async def test_fallback_never_moves_a_state_change_to_another_worker() -> None:
    first = FakeWorker("first", fail(ErrorKind.TRANSIENT, "502 after the write", changed=True, worker="first"))
    second = FakeWorker("second", WorkerResult("second", True, output="answer"))
    result = await run_with_fallback([first, second], "q", breakers={}, policy=RetryPolicy(sleep=Sleeps()), timeout=5)
    assert result.worker == "first"
    assert result.changed_state
    assert len(first.calls) == 1
    assert second.calls == []


async def test_when_every_worker_fails_each_reason_is_reported() -> None:
    first = FakeWorker("first", fail(ErrorKind.PERMANENT, "invalid api key", worker="first"))
    second = FakeWorker("second", fail(ErrorKind.PERMANENT, "model not found", worker="second"))
    result = await run_with_fallback([first, second], "q", breakers={}, policy=RetryPolicy(sleep=Sleeps()), timeout=5)
    assert not result.ok
    assert "first: invalid api key" in result.error
    assert "second: model not found" in result.error

    breakers = breakers_for("first")
    ticket = breakers["first"].admit()
    assert ticket is not None
    breakers["first"].record(ticket, False)
    skipped = await run_with_fallback([first], "q", breakers=breakers, policy=RetryPolicy(), timeout=5)
    assert not skipped.ok
    assert "circuit open (retry in 60 s)" in skipped.error


# -- concurrency --------------------------------------------------------------------------------------


class Gate:
    """Calls that enter, report it, and wait until released, tracking how many are inside at once."""

    def __init__(self) -> None:
        self.inside = 0
        self.peak = 0
        self.entered = asyncio.Semaphore(0)
        self.open = asyncio.Event()

    def call(self, value: int) -> Callable[[], Awaitable[int]]:
        async def run() -> int:
            self.inside += 1
            self.peak = max(self.peak, self.inside)
            self.entered.release()
            await self.open.wait()
            self.inside -= 1
            return value

        return run


async def through(limits: CallLimits, task: asyncio.Semaphore | None, worker: str, gate: Gate, value: int) -> int:
    async with limits.slot(task, worker):
        return await gate.call(value)()


async def test_a_task_slot_bounds_one_task_and_the_process_cap_bounds_every_task() -> None:
    gate = Gate()
    limits = CallLimits(3, {})
    one, other = asyncio.Semaphore(2), asyncio.Semaphore(2)
    calls = [through(limits, one, "w", gate, i) for i in range(5)] + [
        through(limits, other, "w", gate, i) for i in range(5)
    ]
    both = asyncio.gather(*calls)
    for _ in range(3):
        await gate.entered.acquire()
    assert gate.peak == 3  # two tasks of two each would be four: the process allows three
    gate.open.set()
    assert await both == [*range(5), *range(5)]
    assert gate.peak == 3


async def test_a_worker_limit_bounds_its_calls_across_tasks() -> None:
    gate = Gate()
    limits = CallLimits(10, {"slow": 1, "free": None})
    calls = [through(limits, asyncio.Semaphore(5), "slow", gate, i) for i in range(3)]
    calls.append(through(limits, asyncio.Semaphore(5), "free", gate, 9))
    done = asyncio.gather(*calls)
    for _ in range(2):  # one call of "slow" and the one of "free"
        await gate.entered.acquire()
    assert gate.peak == 2
    gate.open.set()
    assert await done == [0, 1, 2, 9]
    assert gate.peak == 2
