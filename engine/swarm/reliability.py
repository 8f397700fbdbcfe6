"""What stands between the swarm and a flaky worker: breakers, retries, timeouts, validation, fallbacks, limits.

Two rules run through all of it. A result whose ``changed_state`` is set is
never repeated — not by a retry and not on a fallback worker — because a
state-changing tool already ran. And only TRANSIENT and TIMEOUT failures are
retried; PERMANENT ones (auth, not found, quota, bad input) fail at once.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import pydantic
import structlog

from kazma.config.backoff import Backoff
from kazma.config.models import WorkerReliability
from kazma.engine.fence import NOTHING, Fenced
from kazma.engine.swarm.types import ErrorKind, Worker, WorkerResult
from kazma.engine.types import ModelError

if TYPE_CHECKING:  # the library itself is imported with the first schema (most runs have none): ~3 MB
    import jsonschema.protocols

log = structlog.get_logger("kazma.swarm")

T = TypeVar("T")

# -- error classification ---------------------------------------------------------------

_PERMANENT_WORDS = re.compile(
    r"invalid[ _-]?api[ _-]?key|unauthori[sz]ed|forbidden|not[ _]found|insufficient[ _]quota|quota|"
    r"authentication|permission denied|\b(?:401|403|404)\b",
    re.IGNORECASE,
)
_TIMEOUT_WORDS = re.compile(r"timed? ?out|timeout|deadline exceeded", re.IGNORECASE)
_TRANSIENT_WORDS = re.compile(
    r"\b5\d\d\b|\b429\b|\b408\b|rate[ _-]?limit|too many requests|connection|connect|temporar|unavailable|"
    r"overloaded|bad gateway|server error|reset by peer|try again",
    re.IGNORECASE,
)


def _from_status(status: int, text: str) -> ErrorKind:
    if status == 429:
        # a spent quota answers 429 too, and waiting a few seconds will not refill it
        return ErrorKind.PERMANENT if "quota" in text.lower() else ErrorKind.TRANSIENT
    if status == 408:
        return ErrorKind.TIMEOUT
    if status >= 500:
        return ErrorKind.TRANSIENT
    return ErrorKind.PERMANENT


def classify_error(error: BaseException | str) -> ErrorKind:
    """Sort a failure into TRANSIENT, TIMEOUT or PERMANENT.

    Auth (401/403, "invalid api key", "unauthorized"), not found (404) and quota
    ("quota", "insufficient_quota", a 429 that mentions quota) are PERMANENT;
    timeouts are TIMEOUT; 5xx, other 429s and connection failures are TRANSIENT.
    Anything unrecognised is PERMANENT: retrying an error nobody understands
    repeats whatever it did.
    """
    if isinstance(error, str):
        text = error
    else:
        text = f"{type(error).__name__}: {error}"
        if isinstance(error, TimeoutError | httpx.TimeoutException):
            return ErrorKind.TIMEOUT
        status = _status_of(error)
        if status is not None:
            return _from_status(status, text)
        if isinstance(error, ModelError):
            if error.permanent:
                return ErrorKind.PERMANENT
            return ErrorKind.TIMEOUT if _TIMEOUT_WORDS.search(text) else ErrorKind.TRANSIENT
        if isinstance(error, httpx.TransportError | ConnectionError):
            return ErrorKind.TRANSIENT
    if _PERMANENT_WORDS.search(text):
        return ErrorKind.PERMANENT
    if _TIMEOUT_WORDS.search(text):
        return ErrorKind.TIMEOUT
    if _TRANSIENT_WORDS.search(text):
        return ErrorKind.TRANSIENT
    return ErrorKind.PERMANENT


def _status_of(error: BaseException) -> int | None:
    if isinstance(error, httpx.HTTPStatusError):
        return error.response.status_code
    for name in ("status_code", "status"):
        value = getattr(error, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def _kind(result: WorkerResult) -> ErrorKind:
    return result.error_kind if result.error_kind is not None else classify_error(result.error)


def _failed(worker: str, exc: Exception) -> WorkerResult:
    return WorkerResult(worker, False, error=f"{type(exc).__name__}: {exc}", error_kind=classify_error(exc))


# -- circuit breaker ----------------------------------------------------------------------


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class Ticket:
    """Leave to make one call; report its outcome with :meth:`CircuitBreaker.record`."""

    worker: str
    generation: int
    probe: bool = False


class CircuitBreaker:
    """Per-worker breaker: closed → open after consecutive failures → one half-open probe → closed or open.

    Every state change starts a new ``generation``; an outcome reported with a
    ticket from an older generation is ignored, so a slow call admitted before
    the breaker opened cannot close it, and a stale probe cannot reopen it.

    A probe that never reports (its caller was cancelled) would wedge the breaker
    half-open, so a probe's lease runs out after ``cooldown``: the next admit then
    gets a fresh probe under a new generation and the old probe's outcome is stale.
    Report each ticket once.
    """

    def __init__(
        self,
        worker: str,
        *,
        failure_threshold: int = 5,
        cooldown: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        self.worker = worker
        self.failure_threshold = failure_threshold
        self.cooldown = cooldown
        self.clock = clock
        self.generation = 0
        self.failures = 0
        self._state = BreakerState.CLOSED
        self._since = clock()  # when OPEN began, or when the outstanding probe was handed out

    @property
    def state(self) -> BreakerState:
        return self._state

    def _move(self, state: BreakerState) -> None:
        previous = self._state
        self._state = state
        self.generation += 1
        self._since = self.clock()
        self.failures = 0
        log.info(
            "swarm.breaker", worker=self.worker, state=state.value, previous=previous.value, generation=self.generation
        )

    def restore(self, state: BreakerState, failures: int, retry_in: float) -> None:
        """Take up a saved state (after a restart): an open breaker rests for what was left of its cooldown.

        A probe that was out when the process stopped never reports: it comes back OPEN, ready to probe again.
        """
        if state is BreakerState.CLOSED:
            self._state, self.failures = BreakerState.CLOSED, max(0, failures)
        else:
            self._state, self.failures = BreakerState.OPEN, 0
            left = 0.0 if state is BreakerState.HALF_OPEN else max(0.0, min(retry_in, self.cooldown))
            self._since = self.clock() - (self.cooldown - left)
        self.generation += 1
        log.info("swarm.breaker_restored", worker=self.worker, state=self._state.value, retry_in=self.retry_in())

    def reset(self) -> None:
        """An operator closes the breaker (``/swarm breaker reset``)."""
        self._move(BreakerState.CLOSED)

    def retry_in(self) -> float:
        """Seconds until a probe may run (0 when closed or when one may run now)."""
        if self._state is BreakerState.CLOSED:
            return 0.0
        return max(0.0, self._since + self.cooldown - self.clock())

    def admit(self) -> Ticket | None:
        """A ticket to call the worker, or None while the breaker refuses."""
        if self._state is BreakerState.CLOSED:
            return Ticket(self.worker, self.generation)
        if self.retry_in() > 0:
            return None
        # OPEN past its cooldown, or HALF_OPEN whose probe's lease ran out: exactly one new probe
        self._move(BreakerState.HALF_OPEN)
        return Ticket(self.worker, self.generation, probe=True)

    def record(self, ticket: Ticket, ok: bool) -> bool:
        """Report a ticket's outcome; False when it was stale and therefore ignored."""
        if ticket.worker != self.worker or ticket.generation != self.generation:
            log.info(
                "swarm.breaker_stale_outcome",
                worker=self.worker,
                ticket_generation=ticket.generation,
                generation=self.generation,
                ok=ok,
            )
            return False
        if self._state is BreakerState.HALF_OPEN:
            self._move(BreakerState.CLOSED if ok else BreakerState.OPEN)
            return True
        if ok:
            self.failures = 0
            return True
        self.failures += 1
        if self.failures >= self.failure_threshold:
            self._move(BreakerState.OPEN)
        return True


# -- retries and timeouts ---------------------------------------------------------------


class RetryPolicy:
    """Retry TRANSIENT and TIMEOUT failures with capped exponential backoff and jitter.

    The defaults are the design's: 3 retries, 1 s doubling to at most 60 s, with jitter. The delay
    before retry ``n`` (1-based) is ``min(cap, base * 2**(n-1))``, scaled
    into ``[delay/2, delay]`` by ``rng`` when ``jitter`` is on so callers that failed
    together do not retry together. PERMANENT failures and any result with
    ``changed_state`` are returned after one attempt.
    """

    def __init__(
        self,
        max_attempts: int = 4,
        base: float = 1.0,
        cap: float = 60.0,
        jitter: bool = True,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.max_attempts = max(1, max_attempts)
        self.backoff = Backoff(base=base, cap=cap, jitter=jitter, rng=rng)
        self.sleep = sleep

    @classmethod
    def of(
        cls,
        settings: WorkerReliability,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: Callable[[], float] = random.random,
    ) -> RetryPolicy:
        """The policy a worker's effective settings describe (``swarm.retries`` under its own ``retries``)."""
        return cls(
            max_attempts=settings.retries + 1,
            base=settings.retry_base_seconds,
            cap=settings.retry_cap_seconds,
            jitter=settings.retry_jitter,
            sleep=sleep,
            rng=rng,
        )

    def delay(self, retry: int) -> float:
        return self.backoff.delay(retry - 1)

    async def run(self, call: Callable[[], Awaitable[WorkerResult]], *, worker: str = "") -> WorkerResult:
        """Call until ok, PERMANENT, changed state, or ``max_attempts``; exceptions become failed results.

        ``worker`` names the worker in results made from exceptions.
        """
        result = WorkerResult(worker, False, error="not attempted", error_kind=ErrorKind.PERMANENT)
        for attempt in range(1, self.max_attempts + 1):
            if attempt > 1:
                await self.sleep(self.delay(attempt - 1))
            try:
                result = await call()
            except Exception as exc:
                result = _failed(worker, exc)
            if result.ok or result.changed_state:
                return result
            kind = _kind(result)
            if kind is ErrorKind.PERMANENT or attempt == self.max_attempts:
                return result  # (the last attempt's failure: no retry follows, none is logged)
            log.info(
                "swarm.retry", worker=result.worker or worker, attempt=attempt, kind=kind.value, error=result.error
            )
        return result


async def with_timeout(
    call: Callable[[], Awaitable[WorkerResult]], seconds: float, *, worker: str = ""
) -> WorkerResult:
    """Run ``call`` for at most ``seconds``; running out becomes a TIMEOUT result, not an exception.

    The call is cancelled, so whether a tool inside it had already changed
    something is unknown; workers that change state must report it before then.
    """
    deadline = asyncio.timeout(seconds)
    try:
        async with deadline:
            return await call()
    except TimeoutError:
        if not deadline.expired():
            raise  # the call's own timeout, not ours: RetryPolicy.run classifies it
        return WorkerResult(worker, False, error=f"timed out after {seconds:g} s", error_kind=ErrorKind.TIMEOUT)


async def run_with_fallback(
    workers: Sequence[Worker],
    prompt: str,
    *,
    context: Fenced = NOTHING,
    breakers: Mapping[str, CircuitBreaker],
    policy: RetryPolicy,
    timeout: float,  # noqa: ASYNC109 - a per-attempt limit, applied inside each retry
) -> WorkerResult:
    """Try ``workers`` in order until one answers ok.

    A worker whose breaker refuses is skipped; a worker without a breaker is
    always tried. A result that changed state is returned as it is, ok or not,
    and no other worker is tried. When every worker fails or is skipped the last
    failure comes back with every worker's reason in ``error``.
    """
    reasons: list[str] = []
    last: WorkerResult | None = None
    for worker in workers:
        name = worker.name
        breaker = breakers.get(name)
        ticket = breaker.admit() if breaker is not None else None
        if breaker is not None and ticket is None:
            reasons.append(f"{name}: circuit open (retry in {math.ceil(breaker.retry_in())} s)")
            continue

        def attempt(w: Worker = worker, n: str = name) -> Awaitable[WorkerResult]:
            return with_timeout(lambda: w.run(prompt, context=context), timeout, worker=n)

        result = await policy.run(attempt, worker=name)
        if breaker is not None and ticket is not None:
            breaker.record(ticket, result.ok)
        if result.ok or result.changed_state:
            return result
        reasons.append(f"{name}: {result.error}")
        last = result
    summary = "; ".join(reasons) or "no workers to try"
    if last is None:
        return WorkerResult("", False, error=f"no worker could be tried: {summary}", error_kind=ErrorKind.TRANSIENT)
    return replace(last, error=f"every worker failed: {summary}")


# -- output validation -------------------------------------------------------------------

_FENCE = re.compile(r"^\s*```[a-zA-Z0-9_-]*\s*\n(.*?)\n?```\s*$", re.DOTALL)


def _schema_validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    """The validator for ``schema``'s own draft (``$schema``; 2020-12 when it names none), after checking the
    schema itself: a mistyped keyword value is refused here, not met as a worker's "invalid output" later."""
    import jsonschema
    import jsonschema.validators

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = exc.json_path if hasattr(exc, "json_path") else "$"
        raise ValueError(f"not a valid JSON schema at {where}: {exc.message}") from None
    return cls(schema)


class OutputValidator:
    """Checks that a worker's output is JSON matching a pydantic model or a JSON schema.

    A single surrounding Markdown code fence (```json … ```) is removed first,
    since models often wrap JSON in one. A JSON schema is checked with the
    ``jsonschema`` library, every keyword of its draft (2020-12 unless its
    ``$schema`` names another); a schema that is itself invalid is refused here
    with a ``ValueError``.
    """

    def __init__(self, spec: type[pydantic.BaseModel] | Mapping[str, Any]) -> None:
        self._model: type[pydantic.BaseModel] | None = None
        self._schema: jsonschema.protocols.Validator | None = None
        if isinstance(spec, type) and issubclass(spec, pydantic.BaseModel):
            self._model = spec
        elif isinstance(spec, Mapping):
            self._schema = _schema_validator(dict(spec))
        else:
            raise TypeError("OutputValidator takes a pydantic model class or a JSON schema dict")

    def validate(self, output: str) -> tuple[bool, str]:
        """``(True, "")`` when valid, else ``(False, reason)``."""
        fenced = _FENCE.match(output)
        text = fenced.group(1) if fenced else output
        if self._model is not None:
            try:
                self._model.model_validate_json(text)
            except pydantic.ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(str(p) for p in e['loc']) or '$'}: {e['msg']}" for e in exc.errors()[:10]
                )
                return False, f"output does not match {self._model.__name__}: {problems}"
            return True, ""
        try:
            value = json.loads(text)
        except ValueError as exc:
            return False, f"output is not JSON: {exc}"
        assert self._schema is not None
        errors = sorted(self._schema.iter_errors(value), key=lambda e: (e.json_path, e.message))
        if errors:
            return False, "output does not match the schema: " + "; ".join(
                f"{e.json_path}: {e.message}" for e in errors[:10]
            )
        return True, ""
