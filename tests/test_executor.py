from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kazma.adapters.human_text import LABEL_PREFIX, for_humans, has_fence
from kazma.config.backoff import Backoff
from kazma.config.store.backend import StoreConnection
from kazma.config.store.database import open_database
from kazma.config.store.postgres import open_pg_store
from kazma.engine.executor import (
    INTERRUPTED,
    MAX_RETRY_WAIT,
    MAX_STEP_ATTEMPTS,
    Action,
    ActionKind,
    AnswerVerdict,
    DispatchFailed,
    PlanExecutor,
    RepairRefused,
    StepResult,
)
from kazma.engine.plan import (
    MAX_STEP_INPUT,
    OnFailure,
    PlanError,
    PlanOrigin,
    PlanSpec,
    StepSpec,
    StepStatus,
    dependencies,
    validate_plan,
)
from kazma.engine.plan_store import MIGRATIONS, PG_MIGRATIONS, PlanStore, TransitionError
from kazma.engine.tools.executions import ExecutionSummary
from tests.store_backends import Engine

WORKERS = {"researcher", "builder", "validator"}
REQUESTER = "telegram:111"
RUNS = (ActionKind.DISPATCH, ActionKind.RUN_LEAD, ActionKind.RESUME)


@dataclass
class RecordingDispatcher:
    store: PlanStore
    actions: list[Action] = field(default_factory=list)
    outstanding: list[tuple[str, int, int]] = field(default_factory=list)
    questions: list[str] = field(default_factory=list)
    asked_lead: list[tuple[str, int]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    fail_next: DispatchFailed | None = None

    async def perform(self, action: Action) -> None:
        self.actions.append(action)
        if action.kind is ActionKind.ASK_USER:
            assert action.question is not None
            self.questions.append(action.question.id)
        if action.kind is ActionKind.ASK_LEAD:
            assert action.step is not None
            self.asked_lead.append((action.plan.id, action.step.index))
        if action.kind in RUNS:
            assert action.step is not None
            if self.fail_next is not None:
                failure, self.fail_next = self.fail_next, None
                raise failure
            plan = await self.store.load(action.plan.id)
            assert plan is not None
            for dep in dependencies(action.step.spec):
                if not plan.steps[dep].status.satisfies:
                    self.violations.append(f"{action.plan.id} step {action.step.index} before dep {dep}")
            if plan.steps[action.step.index].status is not StepStatus.IN_PROGRESS:
                self.violations.append(f"step {action.step.index} dispatched while not in progress")
            busy = (StepStatus.IN_PROGRESS, StepStatus.WAITING_FOR_USER)
            beside = [i for i, s in plan.steps.items() if i != action.step.index and s.status in busy]
            if beside:  # one step at a time
                self.violations.append(f"{action.plan.id} step {action.step.index} ran beside step {beside}")
            self.outstanding.append((action.plan.id, action.step.index, action.step.attempts))

    def dispatched(self) -> list[tuple[str, int]]:
        return [
            (a.plan.id, a.step.index)
            for a in self.actions
            if a.step is not None and a.kind in (ActionKind.DISPATCH, ActionKind.RUN_LEAD)
        ]


def last_kind(d: RecordingDispatcher) -> ActionKind:
    return d.actions[-1].kind


@asynccontextmanager
async def executor(path: Path | str) -> AsyncIterator[tuple[PlanExecutor, RecordingDispatcher]]:
    conn: StoreConnection
    if str(path).startswith("postgresql://"):  # a test database on the suite's PostgreSQL
        conn = await open_pg_store(str(path), migrations=PG_MIGRATIONS, application_name="kazma-test")
    else:
        conn = await open_database(path, migrations=MIGRATIONS)
    store = PlanStore(conn)
    dispatcher = RecordingDispatcher(store)
    try:
        # No backoff before a transient failure's retry: these tests drive the state machine step by step.
        ex = PlanExecutor(store, dispatcher, lead_name="kazma", assignees=WORKERS, retry_backoff=None)
        yield ex, dispatcher
    finally:
        await conn.close()


def spec(*steps: StepSpec) -> PlanSpec:
    return PlanSpec(goal="ship it", steps=list(steps))


def step(index: int, assignee: str = "researcher", **kw: object) -> StepSpec:
    return StepSpec(index=index, title=f"step {index}", assignee=assignee, **kw)  # type: ignore[arg-type]


class HeldSleeps:
    """The executor's retry waits, each held on an event of its own until the test lets it end (in any order)."""

    def __init__(self) -> None:
        self.events: list[asyncio.Event] = []
        self.delays: list[float] = []
        self.tasks: dict[int, asyncio.Task[object]] = {}  # the wait's task, by its event's place in events

    async def __call__(self, delay: float) -> None:
        event = asyncio.Event()
        self.events.append(event)
        self.delays.append(delay)
        task = asyncio.current_task()
        assert task is not None
        self.tasks[len(self.events) - 1] = task
        await event.wait()

    def held(self) -> list[int]:
        """The waits still going (not ended, not cancelled)."""
        return [i for i, e in enumerate(self.events) if not e.is_set() and not self.tasks[i].done()]

    async def end(self, i: int) -> None:
        """End wait ``i`` and let its task move the plan on."""
        self.events[i].set()
        await asyncio.gather(self.tasks[i], return_exceptions=True)


def hold_backoffs(ex: PlanExecutor) -> HeldSleeps:
    """Give ``ex`` a 5-second backoff (no jitter) whose waits the test ends itself, one by one."""
    ex.retry_backoff = Backoff(base=5.0, cap=120.0, jitter=False)
    sleeps = HeldSleeps()
    ex.sleep = sleeps
    return sleeps


@pytest.mark.parametrize(
    ("plan", "problem"),
    [
        (spec(step(1), step(3)), "indices must be 1..2"),
        (spec(step(1, wait_for=[2]), step(2, wait_for=[1])), "cycle: 1 -> 2 -> 1"),
        (spec(step(1, wait_for=[1])), "waits for itself"),
        (spec(step(1), step(2, wait_for=[7])), "waits for step 7, which does not exist"),
        (spec(step(1, assignee="wizard")), "unknown 'wizard'"),
        (spec(step(1), step(2, wait_for=[], input="use {{step_1.output_summary}}")), "does not wait for step 1"),
    ],
)
def test_invalid_plans_are_refused(plan: PlanSpec, problem: str) -> None:
    with pytest.raises(PlanError, match=problem):
        validate_plan(plan, WORKERS | {"kazma"})


async def test_linear_plan_renders_summaries_into_later_inputs(store_engine: Engine) -> None:
    async with executor(store_engine.where) as (ex, d):
        plan = await ex.start(
            "telegram:-1",
            spec(
                step(1, "researcher", input="find sources"),
                step(2, "builder", input="build from: {{step_1.output_summary}}"),
            ),
        )
        assert [a.kind for a in d.actions] == [ActionKind.DISPATCH]
        assert d.actions[0].text.startswith("find sources\n\n[Untrusted data from the plan's goal")
        await ex.complete(plan.id, 1, StepResult(ok=True, summary="three good sources"))
        assert last_kind(d) is ActionKind.DISPATCH
        rendered = d.actions[-1].text
        assert rendered.startswith("build from: \n[Untrusted data from step 1 (researcher)")
        assert "\nthree good sources\n" in rendered
        await ex.complete(plan.id, 2, StepResult(ok=True, summary="built"))
        assert last_kind(d) is ActionKind.FINISHED
        assert await ex.store.plan_status(plan.id) == "finished"


async def test_user_and_lead_steps(store_engine: Engine) -> None:
    async with executor(store_engine.where) as (ex, d):
        origin = PlanOrigin("ship it to the right region", REQUESTER)
        plan = await ex.start("telegram:-1", spec(step(1, "user", input="which region?"), step(2, "kazma")), origin)
        assert last_kind(d) is ActionKind.ASK_USER
        [question] = await ex.open_questions("telegram:-1")
        assert (question.question, question.answerer, question.kind) == ("which region?", REQUESTER, "user_step")
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.WAITING_FOR_USER
        result = await ex.answer(question.id, "eu-west", actor=REQUESTER)
        assert result.verdict is AnswerVerdict.TAKEN
        assert last_kind(d) is ActionKind.RUN_LEAD
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].output_summary == "eu-west"


async def test_failure_policies(store_engine: Engine) -> None:
    async with executor(store_engine.where) as (ex, d):
        aborting = await ex.start("c1", spec(step(1, on_failure=OnFailure.ABORT_PLAN), step(2), step(3)))
        await ex.complete(aborting.id, 1, StepResult(ok=False, error="boom"))
        loaded = await ex.store.load(aborting.id)
        assert loaded is not None
        assert [s.status for s in loaded.steps.values()] == [StepStatus.FAILED, StepStatus.SKIPPED, StepStatus.SKIPPED]

        continuing = await ex.start("c2", spec(step(1, on_failure=OnFailure.CONTINUE), step(2)))
        await ex.complete(continuing.id, 1, StepResult(ok=False, error="meh"))
        loaded = await ex.store.load(continuing.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.SKIPPED
        assert loaded.steps[2].status is StepStatus.IN_PROGRESS

        asking = await ex.start("c3", spec(step(1), step(2), step(3, wait_for=[])))
        await ex.complete(asking.id, 1, StepResult(ok=False, error="no access"))
        loaded = await ex.store.load(asking.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.FAILED
        assert loaded.steps[2].status is StepStatus.PENDING  # waits while the lead decides
        assert loaded.steps[3].status is StepStatus.IN_PROGRESS  # independent work goes on
        ask = [a for a in d.actions if a.kind is ActionKind.ASK_LEAD]
        assert len(ask) == 1
        assert has_fence(ask[0].text)  # the sub-agent's words reach the lead fenced, as data
        assert for_humans(ask[0].text) == f"Step 1 failed:\n{LABEL_PREFIX}step 1's failure:\nno access"
        await ex.lead_decided(asking.id, 1)  # the lead's turn ended without a repair: it gave up on step 1
        loaded = await ex.store.load(asking.id)
        assert loaded is not None
        assert loaded.steps[2].status is StepStatus.BLOCKED


async def test_transient_failures_retry_up_to_the_cap(store_engine: Engine) -> None:
    async with executor(store_engine.where) as (ex, d):
        plan = await ex.start("c", spec(step(1)))
        for _ in range(3):
            await ex.complete(plan.id, 1, StepResult(ok=False, error="HTTP 503", transient=True))
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.FAILED
        assert loaded.steps[1].attempts == 3
        assert d.dispatched() == [(plan.id, 1)] * 3


async def test_a_transient_failure_runs_again_after_a_bounded_backoff_not_at_once(tmp_path: Path) -> None:
    # It was dispatched again at once: a rate-limited model hit again within milliseconds, three times.
    async with executor(tmp_path / "p.db") as (ex, d):
        sleeps = hold_backoffs(ex)
        plan = await ex.start("c", spec(step(1), step(2)))
        assert await ex.complete(plan.id, 1, StepResult(ok=False, error="HTTP 503", transient=True), attempt=1)
        await asyncio.sleep(0)  # the wait starts
        assert sleeps.delays == [5.0]
        assert d.dispatched() == [(plan.id, 1)]  # not again yet, and step 2 does not jump ahead
        notice = d.actions[-1]
        assert notice.kind is ActionKind.NOTICE
        assert notice.text == (
            "Plan: step 1 (step 1) failed for a passing reason (HTTP 503); it runs again in about 5 seconds "
            "(attempt 2 of 3)."
        )
        [waiting] = ex._waits.values()
        sleeps.events[0].set()
        await asyncio.wait_for(waiting, timeout=10)
        assert not ex._waits
        assert d.dispatched() == [(plan.id, 1)] * 2
        # A server's Retry-After wins when longer, bounded; the backoff grows with the attempts.
        assert ex.retry_delay(2, None) == 10.0
        assert ex.retry_delay(1, 30.0) == 30.0
        assert ex.retry_delay(1, 86_400.0) == MAX_RETRY_WAIT


async def test_a_step_waiting_out_its_backoff_when_the_process_stops_runs_at_the_next_start(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    async with executor(path) as (ex, d):
        hold_backoffs(ex)
        plan = await ex.start("c", spec(step(1)))
        assert await ex.complete(plan.id, 1, StepResult(ok=False, error="HTTP 429", transient=True), attempt=1)
        [waiting] = ex._waits.values()
        waiting.cancel()  # the process stops during the wait
    async with executor(path) as (ex, d):  # a new process
        assert await ex.recover() == []
        assert d.dispatched() == [(plan.id, 1)]
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.IN_PROGRESS
        assert loaded.steps[1].attempts == 2


async def test_dispatch_that_cannot_be_posted_is_a_failure_not_a_hang(store_engine: Engine) -> None:
    async with executor(store_engine.where) as (ex, d):
        d.fail_next = DispatchFailed("telegram answered 403", transient=False)
        plan = await ex.start("c", spec(step(1)))
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.FAILED
        assert "dispatch failed: telegram answered 403" in loaded.steps[1].failure_reason


async def test_stale_and_duplicate_completions_change_nothing(store_engine: Engine) -> None:
    async with executor(store_engine.where) as (ex, d):
        plan = await ex.start("c", spec(step(1), step(2)))
        assert not await ex.complete(plan.id, 2, StepResult(ok=True, summary="I did step 2 early"))
        results = await asyncio.gather(*(ex.complete(plan.id, 1, StepResult(ok=True, summary="x")) for _ in range(5)))
        assert sorted(results) == [False, False, False, False, True]
        assert d.dispatched() == [(plan.id, 1), (plan.id, 2)]


async def test_answer_from_an_earlier_attempt_is_stale(store_engine: Engine) -> None:
    async with executor(store_engine.where) as (ex, d):
        plan = await ex.start("c", spec(step(1)))
        assert await ex.complete(plan.id, 1, StepResult(ok=False, error="503", transient=True), attempt=1)
        assert d.actions[-1].step is not None
        assert d.actions[-1].step.attempts == 2
        assert not await ex.complete(plan.id, 1, StepResult(ok=True, summary="late from attempt 1"), attempt=1)
        assert await ex.complete(plan.id, 1, StepResult(ok=True, summary="attempt 2"), attempt=2)
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].output_summary == "attempt 2"


async def test_terminal_states_are_never_left(store_engine: Engine) -> None:
    async with executor(store_engine.where) as (ex, _):
        plan = await ex.start("c", spec(step(1)))
        await ex.complete(plan.id, 1, StepResult(ok=True))
        with pytest.raises(TransitionError):
            await ex.store.set_status(plan.id, 1, StepStatus.DONE, StepStatus.PENDING)


async def test_restart_reports_running_step_interrupted_and_never_redispatches(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    async with executor(path) as (ex, d):
        plan = await ex.start("c", spec(step(1), step(2)))
        assert d.dispatched() == [(plan.id, 1)]
    async with executor(path) as (ex, d):  # a new process
        assert await ex.recover() == [(plan.id, 1)]
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.FAILED
        # the executor in this test records no executions: nothing says a tool started
        assert loaded.steps[1].failure_reason == f"{INTERRUPTED} (tools: {ExecutionSummary().line()})"
        assert loaded.steps[2].status is StepStatus.PENDING  # waits for the lead's decision
        assert d.dispatched() == []
        assert [a.kind for a in d.actions] == [ActionKind.ASK_LEAD]
        assert await ex.complete(plan.id, 1, StepResult(ok=True)) is False  # a late answer changes nothing


@st.composite
def plans(draw: st.DrawFn) -> tuple[PlanSpec, dict[int, str]]:
    n = draw(st.integers(min_value=1, max_value=7))
    steps = []
    outcomes: dict[int, str] = {}
    for index in range(1, n + 1):
        earlier = list(range(1, index))
        if index > 1 and draw(st.booleans()):
            wait_for = draw(st.lists(st.sampled_from(earlier), unique=True, max_size=3))
        else:
            wait_for = None
        steps.append(
            StepSpec(
                index=index,
                title=f"s{index}",
                assignee=draw(st.sampled_from(sorted(WORKERS | {"kazma", "user"}))),
                wait_for=wait_for,
                on_failure=draw(st.sampled_from(list(OnFailure))),
            )
        )
        outcomes[index] = draw(st.sampled_from(["ok", "ok", "fail", "fail", "transient", "ask"]))
    return PlanSpec(goal="g", steps=steps), outcomes


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=st.lists(plans(), min_size=1, max_size=3), seed=st.integers(0, 2**32 - 1))
def test_random_plans_failures_repairs_and_questions_never_dispatch_twice_or_early(
    tmp_path_factory: pytest.TempPathFactory, drawn: list[tuple[PlanSpec, dict[int, str]]], seed: int
) -> None:
    asyncio.run(_drive(tmp_path_factory.mktemp("prop") / "p.db", drawn, random.Random(seed)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=st.lists(plans(), min_size=1, max_size=3), seed=st.integers(0, 2**32 - 1))
def test_random_plans_with_backoffs_ending_in_any_order_never_run_two_steps_at_once_or_one_twice(
    tmp_path_factory: pytest.TempPathFactory, drawn: list[tuple[PlanSpec, dict[int, str]]], seed: int
) -> None:
    # The same, with each transient failure's backoff held until the driver ends it, at any point: beside other
    # steps' completions, failures (transient ones too: two waits at once), questions and the lead's repairs.
    asyncio.run(_drive(tmp_path_factory.mktemp("prop") / "p.db", drawn, random.Random(seed), backoffs=True))


async def _drive(
    path: Path, drawn: list[tuple[PlanSpec, dict[int, str]]], rng: random.Random, *, backoffs: bool = False
) -> None:
    async with executor(path) as (ex, d):
        sleeps = hold_backoffs(ex) if backoffs else HeldSleeps()
        conversations = ["c1", "c1", "c2"]  # two plans may share a conversation (and its lock)
        origin = PlanOrigin("the request", REQUESTER)
        started = []
        for i, (plan_spec, _) in enumerate(drawn):
            # one active plan per conversation at a time for repairs; a second one in c1 starts when the first ends
            started.append(await ex.start(conversations[i] if i != 1 else "c3", plan_spec, origin))
        conversation_of = {plan.id: plan.conversation for plan in started}
        outcome_of = {plan.id: dict(outcomes) for plan, (_, outcomes) in zip(started, drawn, strict=True)}
        transient_budget = {(plan.id, i): 2 if backoffs else 1 for plan in started for i in plan.steps}
        asked: set[tuple[str, int]] = set()
        retried: set[tuple[str, int]] = set()
        # (plan, title) of each replaced step -> how many runs it had when replaced: a step waiting out a backoff
        # is pending, and replaceable, after a run
        replaced_titles: dict[tuple[str, str], int] = {}
        decided = 0
        for _ in range(2_000):
            calls: list[Awaitable[object]] = []
            held = sleeps.held()
            if held and (rng.random() < 0.3 or not (d.outstanding or d.questions or d.asked_lead)):
                # a backoff ends: beside whatever else happens in this round
                calls.append(sleeps.end(rng.choice(held)))
            if d.outstanding:
                rng.shuffle(d.outstanding)
                batch, d.outstanding[:] = d.outstanding[:2], d.outstanding[2:]
                for plan_id, index, attempt in batch:
                    kind = outcome_of[plan_id].get(index, "ok")
                    loaded = await ex.store.load(plan_id)
                    assert loaded is not None
                    is_worker = loaded.steps[index].spec.assignee in WORKERS
                    if kind == "ask" and is_worker and (plan_id, index) not in asked:
                        asked.add((plan_id, index))
                        calls.append(ex.ask_user(plan_id, index, attempt, "which one?", ["a", "b"], asked_by="w"))
                        continue
                    # with backoffs, any step may fail for a passing reason: waits overlap, and meet the rest
                    passing = kind == "transient" or (backoffs and kind == "ok" and rng.random() < 0.5)
                    if passing and transient_budget[(plan_id, index)] > 0:
                        transient_budget[(plan_id, index)] -= 1
                        result = StepResult(ok=False, error="timeout", transient=True)
                    elif kind == "fail":
                        result = StepResult(ok=False, error="boom")
                    else:
                        result = StepResult(ok=True, summary=f"done {index}")
                    # the same answer twice at once, as a duplicate delivery would give
                    calls += [ex.complete(plan_id, index, result, attempt=attempt) for _ in range(2)]
            elif d.questions:
                question_id = d.questions.pop(rng.randrange(len(d.questions)))
                # a stranger first (refused), then the requester; two answers race, one is taken
                assert (await ex.answer(question_id, "a", actor="telegram:999")).verdict is AnswerVerdict.REFUSED
                calls += [ex.answer(question_id, "a", actor=REQUESTER), ex.answer(question_id, "b", actor=REQUESTER)]
            elif d.asked_lead:
                plan_id, index = d.asked_lead.pop(rng.randrange(len(d.asked_lead)))
                conversation = conversation_of[plan_id]
                choice = rng.choice(["retry", "skip", "abort", "replace", "give_up"])
                decided += 1
                try:
                    if choice == "retry" and (plan_id, index) not in retried:
                        retried.add((plan_id, index))
                        outcome_of[plan_id][index] = "ok"
                        await ex.retry_step(conversation, index, None, by="agent:kazma")
                    elif choice == "skip":
                        await ex.skip_step(conversation, index, "not needed", by="agent:kazma")
                    elif choice == "abort":
                        await ex.abort_plan(conversation, "enough", by="agent:kazma")
                    elif choice == "replace":
                        loaded = await ex.store.load(plan_id)
                        assert loaded is not None
                        start_at = index + 1
                        if start_at <= len(loaded.steps):
                            old = {s.spec.title for s in loaded.steps.values() if s.index >= start_at}
                            # a title of its own: a replaced step is recognised by its title wherever it runs
                            title = f"r{start_at}-{decided}"
                            new = [{"index": start_at, "title": title, "assignee": "builder", "wait_for": []}]
                            await ex.replace_steps(conversation, start_at, new, by="agent:kazma")
                            for gone in old:
                                replaced_titles[(plan_id, gone)] = sum(
                                    1 for a in d.actions
                                    if a.kind in (ActionKind.DISPATCH, ActionKind.RUN_LEAD) and a.plan.id == plan_id
                                    and a.step and a.step.spec.title == gone
                                )  # fmt: skip
                            outcome_of[plan_id][start_at] = "ok"
                            if rng.random() < 0.5:
                                # and let the failed step go: whatever still waits on it runs now, so a
                                # replaced step that was not really replaced would run
                                await ex.skip_step(conversation, index, "replaced", by="agent:kazma")
                    await ex.lead_decided(plan_id, index)
                except RepairRefused:
                    await ex.lead_decided(plan_id, index)
            elif not calls:
                break
            await asyncio.gather(*calls)
        assert d.outstanding == []
        assert d.questions == []
        assert d.asked_lead == []
        assert d.violations == []
        runs = [
            (a.plan.id, a.step.index, a.step.attempts, a.step.spec.title)
            for a in d.actions
            if a.step is not None and a.kind in (ActionKind.DISPATCH, ActionKind.RUN_LEAD)
        ]
        assert len(runs) == len(set(runs)), "a step attempt was dispatched twice"
        for (plan_id, title), before in replaced_titles.items():
            # a step is replaced only while pending (the executor refuses otherwise), and never runs after
            ran = sum(1 for p, _, _, t in runs if (p, t) == (plan_id, title))
            assert ran == before, f"replaced step {title} of {plan_id} ran after its replacement"
        for plan in started:
            loaded = await ex.store.load(plan.id)
            assert loaded is not None
            assert all(s.status.terminal for s in loaded.steps.values()), {i: s.status for i, s in loaded.steps.items()}
            assert await ex.open_questions(plan.conversation) == []


async def test_a_retried_step_runs_again_with_new_input_and_its_dependents_go_on(store_engine: Engine) -> None:
    async with executor(store_engine.where) as (ex, d):
        plan = await ex.start("c", spec(step(1), step(2), step(3), step(4)))
        await ex.complete(plan.id, 1, StepResult(ok=True, summary="one"))
        await ex.complete(plan.id, 2, StepResult(ok=False, error="wrong source"))
        assert d.asked_lead == [(plan.id, 2)]
        line = await ex.retry_step("c", 2, "use the mirror instead", by="agent:kazma")
        assert line == "Plan: step 2 (step 2) runs again, with new input."
        assert d.actions[-1].kind is ActionKind.DISPATCH
        assert d.actions[-1].text.startswith("use the mirror instead")
        await ex.lead_decided(plan.id, 2)  # the turn that retried ends: nothing is blocked
        await ex.complete(plan.id, 2, StepResult(ok=True, summary="two"), attempt=2)
        await ex.complete(plan.id, 3, StepResult(ok=True, summary="three"))
        await ex.complete(plan.id, 4, StepResult(ok=True, summary="four"))
        assert d.dispatched() == [(plan.id, 1), (plan.id, 2), (plan.id, 2), (plan.id, 3), (plan.id, 4)]
        assert [e.kind for e in await ex.store.events(plan.id)] == ["retried"]
        assert last_kind(d) is ActionKind.FINISHED


async def test_replaced_steps_never_run_and_the_new_ones_do(store_engine: Engine) -> None:
    async with executor(store_engine.where) as (ex, d):
        plan = await ex.start("c", spec(step(1), step(2), step(3), step(4)))
        await ex.complete(plan.id, 1, StepResult(ok=True, summary="one"))
        await ex.complete(plan.id, 2, StepResult(ok=False, error="cannot"))
        with pytest.raises(RepairRefused, match="step 2 has already run"):
            await ex.replace_steps("c", 2, [{"index": 2, "title": "x", "assignee": "builder"}], by="agent:kazma")
        with pytest.raises(RepairRefused, match="numbered"):
            await ex.replace_steps("c", 3, [{"index": 5, "title": "x", "assignee": "builder"}], by="agent:kazma")
        with pytest.raises(RepairRefused, match="invalid"):
            await ex.replace_steps("c", 3, [{"index": 3, "title": "x", "assignee": "nobody"}], by="agent:kazma")
        new = [
            {"index": 3, "title": "new three", "assignee": "builder", "wait_for": [1]},
            {"index": 4, "title": "new four", "assignee": "validator"},
            {"index": 5, "title": "new five", "assignee": "validator"},
        ]
        await ex.replace_steps("c", 3, new, by="agent:kazma")
        await ex.skip_step("c", 2, "covered by the new steps", by="agent:kazma")
        for index in (3, 4, 5):
            await ex.complete(plan.id, index, StepResult(ok=True, summary=f"n{index}"))
        titles = [a.step.spec.title for a in d.actions if a.kind is ActionKind.DISPATCH and a.step is not None]
        assert titles == ["step 1", "step 2", "new three", "new four", "new five"]
        events = await ex.store.events(plan.id)
        assert [e.kind for e in events] == ["replaced", "skipped"]
        assert '"step 3"' in events[0].detail  # the old steps are kept in the plan's history


async def test_asking_a_person_mid_step_pauses_the_plan_and_resumes_with_the_answer(store_engine: Engine) -> None:
    async with executor(store_engine.where) as (ex, d):
        plan = await ex.start("telegram:-1", spec(step(1), step(2, wait_for=[])), PlanOrigin("go", REQUESTER))
        question = await ex.ask_user(plan.id, 1, 1, "prod or staging?", ["prod", "staging"], asked_by="researcher")
        assert last_kind(d) is ActionKind.ASK_USER
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.WAITING_FOR_USER
        assert loaded.steps[2].status is StepStatus.PENDING  # the plan pauses: nothing else starts
        assert not await ex.complete(plan.id, 1, StepResult(ok=True, summary="the turn that asked ends"), attempt=1)
        stranger = await ex.answer(question.id, "prod", actor="telegram:999")
        assert stranger.verdict is AnswerVerdict.REFUSED
        assert (await ex.answer(question.id, "maybe", actor=REQUESTER)).verdict is AnswerVerdict.REFUSED
        taken = await ex.answer(question.id, "staging", actor=REQUESTER)
        assert taken.verdict is AnswerVerdict.TAKEN
        assert (await ex.answer(question.id, "prod", actor=REQUESTER)).verdict is AnswerVerdict.LOST
        resume = d.actions[-1]
        assert resume.kind is ActionKind.RESUME
        assert "staging" in resume.text
        assert "prod or staging?" in resume.text
        # and the step itself: the asking turn may never have reached the history (a crash) or left it since
        assert "Your step, as it was given to you:" in resume.text
        assert "The request that started it by telegram:111:\ngo" in resume.text
        assert await ex.complete(plan.id, 1, StepResult(ok=True, summary="deployed to staging"), attempt=1)
        assert d.dispatched() == [(plan.id, 1), (plan.id, 2)]


async def test_an_admin_may_answer_and_a_restart_shows_open_questions_again(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    async with executor(path) as (ex, d):
        plan = await ex.start("telegram:-1", spec(step(1, "user", input="budget?")), PlanOrigin("go", REQUESTER))
        [question] = d.questions
    async with executor(path) as (ex, d):  # a new process
        assert await ex.recover() == []  # a question is not an interrupted step
        assert [a.kind for a in d.actions] == [ActionKind.ASK_USER]
        assert d.actions[0].question is not None
        assert d.actions[0].question.id == question
        wrong_platform = await ex.answer(question, "10k", actor="slack:U1", is_admin=True)
        assert wrong_platform.verdict is AnswerVerdict.REFUSED
        admin = await ex.answer(question, "10k", actor="telegram:5", is_admin=True)
        assert admin.verdict is AnswerVerdict.TAKEN
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.DONE


async def test_every_step_sees_the_original_request_and_the_goal_fenced(store_engine: Engine) -> None:
    async with executor(store_engine.where) as (ex, d):
        origin = PlanOrigin("Please name the release 'Zanzibar' and ship it", REQUESTER)
        plan = await ex.start("c", spec(step(1), step(2), step(3, input="write the notes")), origin)
        await ex.complete(plan.id, 1, StepResult(ok=True))
        await ex.complete(plan.id, 2, StepResult(ok=True))
        third = d.actions[-1].text
        assert third.startswith("write the notes")
        assert "Zanzibar" in third
        assert "[Untrusted data from the plan's goal and original request" in third
        assert f"by {REQUESTER}" in third
        assert plan.id


async def test_a_long_request_is_bounded_with_its_cut_marked(store_engine: Engine) -> None:
    async with executor(store_engine.where) as (ex, d):
        origin = PlanOrigin("HEAD " + "x" * 20_000 + " TAIL", REQUESTER)
        await ex.start("c", spec(step(1)), origin)
        text = d.actions[-1].text
        assert "HEAD" in text
        assert "TAIL" in text
        assert "characters not shown]" in text
        assert len(text) < 6_000


async def test_output_files_reach_later_steps_and_the_plan_view(store_engine: Engine) -> None:
    async with executor(store_engine.where) as (ex, d):
        plan = await ex.start(
            "c", spec(step(1), step(2, input="check {{step_1.output_files}}")), PlanOrigin("go", REQUESTER)
        )
        await ex.complete(plan.id, 1, StepResult(ok=True, summary="built", files=("dist/app.tar", "NOTES.md")))
        assert "dist/app.tar\nNOTES.md" in d.actions[-1].text
        view = await ex.describe("c")
        assert "files: dist/app.tar, NOTES.md" in view
        assert "[in_progress] step 2" in view


async def test_repairing_one_of_two_failed_dependencies_leaves_the_step_blocked(store_engine: Engine) -> None:
    # Found by the property test: skipping step 1 used to free step 3, which still waited on the
    # given-up step 2, so the plan never finished.
    async with executor(store_engine.where) as (ex, _d):
        plan = await ex.start("c", spec(step(1), step(2, wait_for=[]), step(3, wait_for=[1, 2]), step(4, wait_for=[])))
        await ex.complete(plan.id, 1, StepResult(ok=False, error="one"))
        await ex.complete(plan.id, 2, StepResult(ok=False, error="two"))  # step 4 runs meanwhile
        await ex.lead_decided(plan.id, 2)  # the lead gave up on step 2: step 3 is blocked
        await ex.skip_step("c", 1, "not needed", by="agent:kazma")
        await ex.lead_decided(plan.id, 1)
        await ex.complete(plan.id, 4, StepResult(ok=True, summary="four"))
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert {i: s.status for i, s in loaded.steps.items()} == {
            1: StepStatus.SKIPPED,
            2: StepStatus.FAILED,
            3: StepStatus.BLOCKED,
            4: StepStatus.DONE,
        }
        assert loaded.status == "finished"


async def test_a_restart_moves_on_a_plan_whose_step_ended_just_before_the_process_died(store_engine: Engine) -> None:
    """A step's ending commits before the plan moves on; a process that died between the two left the plan idle
    for good (found by the chaos matrix's plan.complete=crash cell: the lead never asked, the next step never
    handed out). The next start moves it on: the lead is asked about a failure whose dependents wait, the next
    step goes out after a success, a plan whose last step ended finishes."""
    async with executor(store_engine.where) as (ex, d):
        failed = await ex.start("c1", spec(step(1), step(2)))
        done = await ex.start("c2", spec(step(1), step(2)))
        last = await ex.start("c3", spec(step(1)))
        # what _record commits, and then the process dies before _next_actions
        assert await ex.store.set_status(
            failed.id, 1, StepStatus.IN_PROGRESS, StepStatus.FAILED, failure_reason="no access"
        )
        assert await ex.store.set_status(done.id, 1, StepStatus.IN_PROGRESS, StepStatus.DONE, output_summary="ok")
        assert await ex.store.set_status(last.id, 1, StepStatus.IN_PROGRESS, StepStatus.DONE, output_summary="ok")
    async with executor(store_engine.where) as (ex, d):  # the next start
        assert await ex.recover() == []  # nothing was running: nothing interrupted
        assert d.asked_lead == [(failed.id, 1)]
        ask = next(a for a in d.actions if a.kind is ActionKind.ASK_LEAD)
        assert has_fence(ask.text)
        assert for_humans(ask.text) == f"Step 1 failed:\n{LABEL_PREFIX}step 1's failure:\nno access"
        assert d.dispatched() == [(done.id, 2)]
        assert await ex.store.plan_status(last.id) == "finished"
        assert any(a.kind is ActionKind.FINISHED and a.plan.id == last.id for a in d.actions)
        assert d.violations == []
    async with executor(store_engine.where) as (ex, d):  # and once moved on, a later start leaves it be
        await ex.lead_decided(failed.id, 1)  # the lead gave up on step 1 this time
        assert await ex.recover() == [(done.id, 2)]  # step 2 was running when this "process" started
        assert d.asked_lead == [(done.id, 2)]
        assert d.dispatched() == []


async def test_a_restart_resumes_a_step_whose_answer_was_recorded_just_before_the_process_died(
    store_engine: Engine,
) -> None:
    """The answer commits before the step resumes; a process that died between the two left the step waiting for
    a person with no question open, for good (found by plan.question.answered=crash). The next start resumes
    it with the answer given, once."""
    async with executor(store_engine.where) as (ex, d):
        plan = await ex.start("telegram:-1", spec(step(1), step(2)), PlanOrigin("go", REQUESTER))
        question = await ex.ask_user(plan.id, 1, 1, "prod or staging?", ["prod", "staging"], asked_by="researcher")
        # what answer() commits, and then the process dies before _take_answer
        assert await ex.store.settle_question(question.id, "answered", answer="staging", actor=REQUESTER)
    async with executor(store_engine.where) as (ex, d):  # the next start
        assert await ex.recover() == []
        [resume] = [a for a in d.actions if a.kind is ActionKind.RESUME]
        assert resume.step is not None
        assert resume.step.index == 1
        assert "staging" in resume.text
        assert not [a for a in d.actions if a.kind is ActionKind.ASK_USER]  # answered: not asked again
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.IN_PROGRESS
        assert await ex.complete(plan.id, 1, StepResult(ok=True, summary="deployed to staging"), attempt=1)
        assert d.dispatched()[-1] == (plan.id, 2)
    async with executor(store_engine.where) as (ex, d):  # resumed once: a later start does not again
        assert await ex.recover() == [(plan.id, 2)]
        assert not [a for a in d.actions if a.kind is ActionKind.RESUME]


async def test_a_second_plan_in_a_conversation_with_an_active_one_is_refused(store_engine: Engine) -> None:
    # With two active plans the repairs (which name no plan) landed on the newest: the lead, asked about plan A's
    # failed step, aborted plan B, another person's, whose running step kept running.
    async with executor(store_engine.where) as (ex, _d):
        first = await ex.start("c", spec(step(1), step(2)), PlanOrigin("release notes", "telegram:111"))
        with pytest.raises(PlanError, match=f"plan {first.id} \\(.*\\), asked for by telegram:111, is still active"):
            await ex.start("c", spec(step(1)), PlanOrigin("migrate the db", "telegram:222"))
        elsewhere = await ex.start("other", spec(step(1)), PlanOrigin("migrate the db", "telegram:222"))
        await ex.complete(first.id, 1, StepResult(ok=False, error="no access"))
        await ex.abort_plan("c", "hopeless", by="agent:kazma")
        aborted = await ex.store.load(first.id)
        assert aborted is not None
        assert aborted.status == "aborted"
        untouched = await ex.store.load(elsewhere.id)
        assert untouched is not None
        assert untouched.status == "active"
        again = await ex.start("c", spec(step(1)), PlanOrigin("try again", "telegram:111"))  # the first has ended
        assert again.id != first.id


async def test_the_last_step_failing_under_ask_lead_leaves_the_plan_open_for_the_leads_repair(
    store_engine: Engine,
) -> None:
    # The failed last step made every step terminal: the plan finished at once, beside the ASK_LEAD, and the
    # lead's retry_step was refused ("there is no active plan in this conversation").
    async with executor(store_engine.where) as (ex, d):
        plan = await ex.start("c", spec(step(1), step(2)))
        await ex.complete(plan.id, 1, StepResult(ok=True, summary="one"))
        await ex.complete(plan.id, 2, StepResult(ok=False, error="no access"))
        assert last_kind(d) is ActionKind.ASK_LEAD
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.status == "active"
        assert await ex.retry_step("c", 2, None, by="agent:kazma") == "Plan: step 2 (step 2) runs again, as it was."
        await ex.complete(plan.id, 2, StepResult(ok=True, summary="two"), attempt=2)
        assert last_kind(d) is not ActionKind.FINISHED  # the lead's turn is still going
        await ex.lead_decided(plan.id, 2, 1)  # the turn that retried ends
        assert last_kind(d) is ActionKind.FINISHED
        done = await ex.store.load(plan.id)
        assert done is not None
        assert done.status == "finished"


async def test_an_earlier_leads_turn_ending_leaves_a_newer_failure_to_the_turn_asked_about_it(
    store_engine: Engine,
) -> None:
    # Turn 1 retried step 1, whose new attempt failed at once (turn 2 asked); turn 1 then ended and its
    # lead_decided gave the step up: the plan finished, and turn 2's retry was refused.
    async with executor(store_engine.where) as (ex, d):
        plan = await ex.start("c", spec(step(1), step(2)))
        await ex.complete(plan.id, 1, StepResult(ok=False, error="flaky"))
        await ex.retry_step("c", 1, None, by="agent:kazma")  # turn 1
        await ex.complete(plan.id, 1, StepResult(ok=False, error="flaky again"), attempt=2)  # turn 2 is asked
        await ex.lead_decided(plan.id, 1, 1)  # turn 1 ends
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.status == "active"
        assert loaded.steps[2].status is StepStatus.PENDING  # not blocked
        assert (
            await ex.retry_step("c", 1, None, by="agent:kazma") == "Plan: step 1 (step 1) runs again, as it was."
        )  # turn 2
        await ex.complete(plan.id, 1, StepResult(ok=True, summary="one"), attempt=3)
        await ex.lead_decided(plan.id, 1, 2)
        await ex.complete(plan.id, 2, StepResult(ok=True, summary="two"))
        assert last_kind(d) is ActionKind.FINISHED


async def test_a_step_that_succeeded_after_a_transient_failure_shows_no_old_error(store_engine: Engine) -> None:
    # /plan said "[done] step 1 — @researcher: model timed out" and the finish report fed that to the lead.
    async with executor(store_engine.where) as (ex, _d):
        plan = await ex.start("c", spec(step(1)))
        await ex.complete(plan.id, 1, StepResult(ok=False, error="model timed out after 60 s", transient=True))
        running = await ex.describe("c")
        assert "[in_progress] step 1 — @researcher" in running
        assert "timed out" not in running
        await ex.complete(plan.id, 1, StepResult(ok=True, summary=""), attempt=2)
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].failure_reason == ""
        assert "timed out" not in await ex.describe("c")


async def test_a_reply_with_spaces_or_a_newline_around_a_choice_is_that_choice(store_engine: Engine) -> None:
    # Chat text comes unstripped (Matrix, Slack, Discord): "staging\n" was refused as no choice, and the chat side
    # took the refusal for a stranger's reply and said nothing.
    async with executor(store_engine.where) as (ex, _d):
        plan = await ex.start("telegram:-1", spec(step(1)), PlanOrigin("go", REQUESTER))
        question = await ex.ask_user(plan.id, 1, 1, "prod or staging?", ["prod", "staging"], asked_by="researcher")
        taken = await ex.answer(question.id, "  staging\n", actor=REQUESTER)
        assert taken.verdict is AnswerVerdict.TAKEN
        settled = await ex.store.question(question.id)
        assert settled is not None
        assert settled.answer == "staging"


async def test_a_step_input_naming_many_outputs_is_bounded_with_the_cut_said(store_engine: Engine) -> None:
    # Each {{step_N.output_summary}} is bounded, but not how many an input names: 70 of them made 1.2 MB that was
    # posted, kept in the history and sent to a model; 20,000 output files made 380 KB.
    refs = " ".join(f"{{{{step_{i}.output_summary}}}}" for i in range(1, 21))
    steps = [
        *(step(i, wait_for=[]) for i in range(1, 21)),
        step(21, input="{{step_1.output_files}}", wait_for=[1]),
        step(22, input=refs, wait_for=list(range(1, 21))),
    ]
    async with executor(store_engine.where) as (ex, _d):
        plan = await ex.start("c", PlanSpec(goal="many", steps=steps))
        for i in range(1, 21):
            files = tuple(f"f{n}.txt" for n in range(2_000)) if i == 1 else ()
            await ex.complete(plan.id, i, StepResult(ok=True, summary="x" * 1_500, files=files))
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        listed = loaded.render_input(loaded.steps[21], context=False)
        assert "f49.txt" in listed
        assert "f50.txt" not in listed
        assert "(+1950 more files)" in listed
        summaries = loaded.render_input(loaded.steps[22], context=False)
        assert len(summaries) < MAX_STEP_INPUT + 1_000, len(summaries)  # the budget, fences included, and the note
        assert "[left out, this step's input being at its limit: step 10 (researcher)'s summary" in summaries


async def test_a_step_retried_again_and_again_is_refused_at_its_limit(store_engine: Engine) -> None:
    # retry_step had no limit: a lead that always retried looped failure -> ask -> retry for ever.
    async with executor(store_engine.where) as (ex, _d):
        plan = await ex.start("c", spec(step(1)))
        attempt = 1
        await ex.complete(plan.id, 1, StepResult(ok=False, error="no"), attempt=attempt)
        while attempt < MAX_STEP_ATTEMPTS:
            await ex.retry_step("c", 1, None, by="agent:kazma")
            attempt += 1
            await ex.complete(plan.id, 1, StepResult(ok=False, error="no"), attempt=attempt)
        with pytest.raises(RepairRefused, match=f"step 1 has run {MAX_STEP_ATTEMPTS} times; it is not retried again"):
            await ex.retry_step("c", 1, None, by="agent:kazma")
        assert "skipped" in await ex.skip_step("c", 1, "it will not work", by="agent:kazma")


async def test_the_last_step_failed_and_undecided_when_kazma_stopped_asks_the_lead_again_at_start(
    tmp_path: Path,
) -> None:
    # The lead was asked only again about a failed step whose dependents still waited: the last step has none, so
    # after a restart the plan finished at once and the lead's repair was refused.
    path = tmp_path / "p.db"
    async with executor(path) as (ex, d):
        plan = await ex.start("c", spec(step(1), step(2)))
        await ex.complete(plan.id, 1, StepResult(ok=True, summary="one"))
        await ex.complete(plan.id, 2, StepResult(ok=False, error="no access"))
        assert last_kind(d) is ActionKind.ASK_LEAD
    async with executor(path) as (ex, d):  # Kazma stopped during the lead's turn, and started again
        await ex.recover()
        assert [a.kind for a in d.actions] == [ActionKind.ASK_LEAD]
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.status == "active"
        await ex.lead_decided(plan.id, 2, 1)  # this time the lead gives up: the plan finishes
        assert last_kind(d) is ActionKind.FINISHED


def dispatches(d: RecordingDispatcher, plan_id: str) -> list[tuple[int, int, str]]:
    """Every hand-off of the plan: (step, attempt, the note shown beside its mention)."""
    return [
        (a.step.index, a.step.attempts, a.note)
        for a in d.actions
        if a.step is not None and a.plan.id == plan_id and a.kind is ActionKind.DISPATCH
    ]


async def test_a_retried_hand_off_says_which_try_it_is_and_nothing_of_the_failures_words(store_engine: Engine) -> None:
    # The retry's "@researcher …" was the first one word for word: people took it for a duplicate hand-off and
    # could not tell why the step was handed out again.
    async with executor(store_engine.where) as (ex, d):
        plan = await ex.start("c", spec(step(1, input="Find the sources.")))
        await ex.complete(plan.id, 1, StepResult(ok=False, error="HTTP 503:\n  service   unavailable", transient=True))
        await ex.complete(plan.id, 1, StepResult(ok=False, error="model timed out " + "x" * 200, transient=True))
        [first, second, third] = dispatches(d, plan.id)
        assert first == (1, 1, "")  # a first hand-off is not marked
        assert second == (1, 2, "(try 2 of 3)")
        assert third == (1, 3, "(try 3 of 3)")
        handed = [a for a in d.actions if a.kind is ActionKind.DISPATCH]
        assert {a.text.splitlines()[0] for a in handed} == {"Find the sources."}  # the step's own input each time
        # Past the executor's own tries the lead may run it again: the try is counted, without a total.
        await ex.complete(plan.id, 1, StepResult(ok=False, error="HTTP 502", transient=True), attempt=3)
        assert d.asked_lead == [(plan.id, 1)]
        await ex.retry_step("c", 1, None, by="agent:kazma")
        assert dispatches(d, plan.id)[-1] == (1, 4, "(try 4)")
        await ex.complete(plan.id, 1, StepResult(ok=True, summary="found"), attempt=4)
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].failure_reason == ""  # done: the earlier tries' failure is not its story


async def test_a_step_waiting_out_its_backoff_lets_a_step_that_does_not_need_it_run(tmp_path: Path) -> None:
    # While step 1 waited out its backoff (up to two minutes), step 2 — which does not wait for it — waited too.
    async with executor(tmp_path / "p.db") as (ex, d):
        sleeps = hold_backoffs(ex)
        plan = await ex.start("c", spec(step(1), step(2, wait_for=[]), step(3, wait_for=[1])))
        assert await ex.complete(plan.id, 1, StepResult(ok=False, error="HTTP 429", transient=True), attempt=1)
        assert [(i, n) for i, n, _ in dispatches(d, plan.id)] == [(1, 1), (2, 1)]  # step 2 goes on now
        [notice] = [a.text for a in d.actions if a.kind is ActionKind.NOTICE]
        assert notice == (
            "Plan: step 1 (step 1) failed for a passing reason (HTTP 429); it runs again in about 5 seconds at the "
            "earliest (attempt 2 of 3). Meanwhile step 2 (step 2), which does not need it, goes on; step 1 waits for "
            "it to end."
        )
        [waiting] = ex._waits.values()
        # Its backoff ends while step 2 runs: still one step at a time, so step 1 waits for step 2 to end.
        sleeps.events[0].set()
        await asyncio.wait_for(waiting, timeout=10)
        assert [(i, n) for i, n, _ in dispatches(d, plan.id)] == [(1, 1), (2, 1)]
        await ex.complete(plan.id, 2, StepResult(ok=True, summary="two"), attempt=1)
        assert dispatches(d, plan.id)[-1] == (1, 2, "(try 2 of 3)")
        await ex.complete(plan.id, 1, StepResult(ok=True, summary="one"), attempt=2)
        assert dispatches(d, plan.id)[-1][:2] == (3, 1)  # step 3 only after step 1, which it needs
        await ex.complete(plan.id, 3, StepResult(ok=True, summary="three"), attempt=1)
        assert last_kind(d) is ActionKind.FINISHED
        assert d.violations == []


async def test_a_step_in_backoff_does_not_jump_a_step_that_went_on_meanwhile_or_wait_behind_a_finished_one(
    tmp_path: Path,
) -> None:
    # Step 2 (independent) finishes while step 1 still waits its backoff: nothing else is ready, so nothing runs
    # until the backoff ends; then step 1 runs, and the plan ends.
    async with executor(tmp_path / "p.db") as (ex, d):
        sleeps = hold_backoffs(ex)
        plan = await ex.start("c", spec(step(1), step(2, wait_for=[])))
        await ex.complete(plan.id, 1, StepResult(ok=False, error="HTTP 503", transient=True), attempt=1)
        await ex.complete(plan.id, 2, StepResult(ok=True, summary="two"), attempt=1)
        assert [(i, n) for i, n, _ in dispatches(d, plan.id)] == [(1, 1), (2, 1)]
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.status == "active"  # not finished: step 1 runs again
        [waiting] = ex._waits.values()
        sleeps.events[0].set()
        await asyncio.wait_for(waiting, timeout=10)
        assert dispatches(d, plan.id)[-1] == (1, 2, "(try 2 of 3)")
        await ex.complete(plan.id, 1, StepResult(ok=True, summary="one"), attempt=2)
        assert last_kind(d) is ActionKind.FINISHED


async def test_aborting_a_plan_ends_a_steps_backoff_at_once(tmp_path: Path) -> None:
    # A step waiting out its backoff while another ran: the abort must end the wait too, not leave it to fire.
    async with executor(tmp_path / "p.db") as (ex, d):
        hold_backoffs(ex)
        plan = await ex.start("c", spec(step(1), step(2, wait_for=[])))
        await ex.complete(plan.id, 1, StepResult(ok=False, error="HTTP 503", transient=True), attempt=1)
        [waiting] = ex._waits.values()
        assert [(i, n) for i, n, _ in dispatches(d, plan.id)] == [(1, 1), (2, 1)]
        await ex.abort_plan("c", "enough", by="agent:kazma")
        assert not ex._waits
        await asyncio.wait_for(asyncio.gather(waiting, return_exceptions=True), timeout=10)
        assert waiting.cancelled()
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.status == "aborted"
        assert loaded.steps[1].status is StepStatus.SKIPPED
        assert loaded.steps[2].status is StepStatus.FAILED  # it was running: failed as aborted while it ran
        assert [(i, n) for i, n, _ in dispatches(d, plan.id)] == [(1, 1), (2, 1)]


async def test_a_step_replaced_while_its_old_self_waited_out_a_backoff_starts_without_that_wait(
    tmp_path: Path,
) -> None:
    # The backoff of the step that was replaced held the index: the new step 2 did not start until it ended.
    async with executor(tmp_path / "p.db") as (ex, d):
        hold_backoffs(ex)
        plan = await ex.start("c", spec(step(1), step(2), step(3)))
        await ex.complete(plan.id, 1, StepResult(ok=True, summary="one"), attempt=1)
        await ex.complete(plan.id, 2, StepResult(ok=False, error="HTTP 503", transient=True), attempt=1)
        [waiting] = ex._waits.values()
        new = [{"index": 2, "title": "other", "assignee": "builder"}]
        await ex.replace_steps("c", 2, new, by="agent:kazma")
        assert dispatches(d, plan.id)[-1] == (2, 1, "")  # the new step 2, handed out at once
        assert not ex._waits
        await asyncio.wait_for(asyncio.gather(waiting, return_exceptions=True), timeout=10)
        assert waiting.cancelled()
        await ex.complete(plan.id, 2, StepResult(ok=True, summary="two"), attempt=1)
        assert last_kind(d) is ActionKind.FINISHED


async def test_skipping_a_step_that_waits_out_its_backoff_ends_the_wait(tmp_path: Path) -> None:
    # The skipped step's wait lived on (up to two minutes) and then moved a plan on that had nothing left of it.
    async with executor(tmp_path / "p.db") as (ex, d):
        hold_backoffs(ex)
        plan = await ex.start("c", spec(step(1), step(2)))
        await ex.complete(plan.id, 1, StepResult(ok=False, error="HTTP 503", transient=True), attempt=1)
        [waiting] = ex._waits.values()
        await ex.skip_step("c", 1, "not needed after all", by="agent:kazma")
        assert dispatches(d, plan.id)[-1][:2] == (2, 1)
        assert not ex._waits
        await asyncio.wait_for(asyncio.gather(waiting, return_exceptions=True), timeout=10)
        assert waiting.cancelled()


def running(d: RecordingDispatcher, plan_id: str) -> list[tuple[int, int]]:
    """(step, attempt) of every run of the plan handed out, in order."""
    return [(a.step.index, a.step.attempts) for a in d.actions
            if a.step is not None and a.plan.id == plan_id and a.kind in RUNS]  # fmt: skip


async def test_two_steps_waiting_out_backoffs_at_once_each_run_once_one_at_a_time_and_the_notice_says_so(
    tmp_path: Path,
) -> None:
    # Step 1 waits out its backoff, step 2 goes on and fails for a passing reason too. Its notice said "it runs again
    # in about 5 seconds" — but step 1's wait may end first, and step 2 then waits for all of step 1's run.
    async with executor(tmp_path / "p.db") as (ex, d):
        sleeps = hold_backoffs(ex)
        plan = await ex.start("c", spec(step(1), step(2, wait_for=[]), step(3, wait_for=[1, 2])))
        await ex.complete(plan.id, 1, StepResult(ok=False, error="HTTP 429", transient=True), attempt=1)
        await ex.complete(plan.id, 2, StepResult(ok=False, error="HTTP 503", transient=True), attempt=1)
        assert running(d, plan.id) == [(1, 1), (2, 1)]
        notice = [a.text for a in d.actions if a.kind is ActionKind.NOTICE][-1]
        assert notice == (
            "Plan: step 2 (step 2) failed for a passing reason (HTTP 503); it runs again in about 5 seconds at the "
            "earliest (attempt 2 of 3). Step 1 (step 1) waits to run again too, and one step runs at a time."
        )
        first, second = ex._waits[(plan.id, 1)], ex._waits[(plan.id, 2)]
        sleeps.events[0].set()  # step 1's wait ends first: it runs
        await asyncio.wait_for(first, timeout=10)
        assert running(d, plan.id) == [(1, 1), (2, 1), (1, 2)]
        sleeps.events[1].set()  # step 2's ends while step 1 runs: it waits for it, not beside it
        await asyncio.wait_for(second, timeout=10)
        assert running(d, plan.id) == [(1, 1), (2, 1), (1, 2)]
        assert not ex._waits
        await ex.complete(plan.id, 1, StepResult(ok=True, summary="one"), attempt=2)
        assert running(d, plan.id)[-1] == (2, 2)
        assert dispatches(d, plan.id)[-1] == (2, 2, "(try 2 of 3)")
        await ex.complete(plan.id, 2, StepResult(ok=True, summary="two"), attempt=2)
        assert running(d, plan.id)[-1] == (3, 1)
        await ex.complete(plan.id, 3, StepResult(ok=True, summary="three"), attempt=1)
        assert last_kind(d) is ActionKind.FINISHED
        assert d.violations == []


async def test_a_restart_during_a_backoff_with_another_step_running_runs_the_waiting_step_once(tmp_path: Path) -> None:
    # Step 1 waits out its backoff (in memory), step 2 runs; the process stops. At the start step 2 is interrupted
    # (the lead asked), and step 1 — pending on disk, its wait gone — must run once: not never, not twice.
    path = tmp_path / "p.db"
    async with executor(path) as (ex, d):
        hold_backoffs(ex)
        plan = await ex.start("c", spec(step(1), step(2, wait_for=[]), step(3, wait_for=[1])))
        await ex.complete(plan.id, 1, StepResult(ok=False, error="HTTP 429", transient=True), attempt=1)
        assert running(d, plan.id) == [(1, 1), (2, 1)]
        [waiting] = ex._waits.values()
        waiting.cancel()  # the process stops
    async with executor(path) as (ex, d):
        hold_backoffs(ex)
        assert await ex.recover() == [(plan.id, 2)]
        assert d.asked_lead == [(plan.id, 2)]
        assert running(d, plan.id) == []  # the lead decides first: nothing runs beside its turn's repair
        await ex.lead_decided(plan.id, 2, 1)  # the lead gave step 2 up
        assert dispatches(d, plan.id) == [(1, 2, "(try 2 of 3)")]
        await ex.lead_decided(plan.id, 2, 1)
        await ex.complete(plan.id, 1, StepResult(ok=True, summary="one"), attempt=2)
        assert running(d, plan.id) == [(1, 2), (3, 1)]
        assert d.violations == []


async def test_a_backoff_over_before_its_notice_is_written_is_not_said_to_wait_for_itself(tmp_path: Path) -> None:
    # The wait's task runs while the notice reads the plan (a store slow to answer, a backoff of a few seconds):
    # its step is ready again and the lowest, so the notice named it as the step that "goes on" meanwhile.
    async with executor(tmp_path / "p.db") as (ex, d):
        ex.retry_backoff = Backoff(base=5.0, cap=120.0, jitter=False)

        async def over(delay: float) -> None:
            return None

        ex.sleep = over
        plan = await ex.start("c", spec(step(1), step(2, wait_for=[])))
        await ex.complete(plan.id, 1, StepResult(ok=False, error="HTTP 429", transient=True), attempt=1)
        notice = next(a.text for a in d.actions if a.kind is ActionKind.NOTICE)
        assert (
            notice
            == "Plan: step 1 (step 1) failed for a passing reason (HTTP 429); it runs again now (attempt 2 of 3)."
        )
        assert running(d, plan.id) == [(1, 1), (1, 2)]  # it is the step that runs: its wait is over
        assert d.violations == []


async def test_a_retry_notice_while_the_lead_decides_about_another_step_does_not_promise_when(tmp_path: Path) -> None:
    # Step 1 failed, the lead decides; step 2 went on and failed for a passing reason: "it runs again in about 5
    # seconds". The lead then runs step 1 again, at once: step 2's wait ends while step 1 runs, and it waits for it.
    async with executor(tmp_path / "p.db") as (ex, d):
        sleeps = hold_backoffs(ex)
        plan = await ex.start("c", spec(step(1), step(2, wait_for=[])))
        await ex.complete(plan.id, 1, StepResult(ok=False, error="wrong file"), attempt=1)
        assert d.asked_lead == [(plan.id, 1)]
        await ex.complete(plan.id, 2, StepResult(ok=False, error="HTTP 503", transient=True), attempt=1)
        notice = [a.text for a in d.actions if a.kind is ActionKind.NOTICE][-1]
        assert "it runs again in about 5 seconds at the earliest (attempt 2 of 3)" in notice, notice
        await ex.retry_step("c", 1, None, by="agent:kazma")
        [waiting] = ex._waits.values()
        sleeps.events[0].set()
        await asyncio.wait_for(waiting, timeout=10)
        assert running(d, plan.id) == [(1, 1), (2, 1), (1, 2)]  # step 2 waits for step 1's run: "at the earliest"
        await ex.complete(plan.id, 1, StepResult(ok=True, summary="one"), attempt=2)
        assert running(d, plan.id)[-1] == (2, 2)
        assert d.violations == []


async def test_the_leads_retry_of_a_step_waiting_out_its_backoff_is_told_it_runs_again_by_itself(
    tmp_path: Path,
) -> None:
    # The lead, reading the notice, asked to retry the step: "step 1 is pending; only a failed step can be retried"
    # — as if it had never run.
    async with executor(tmp_path / "p.db") as (ex, d):
        hold_backoffs(ex)
        plan = await ex.start("c", spec(step(1), step(2, wait_for=[])))
        await ex.complete(plan.id, 1, StepResult(ok=False, error="HTTP 429", transient=True), attempt=1)
        with pytest.raises(RepairRefused) as refused:
            await ex.retry_step("c", 1, "try harder", by="agent:kazma")
        assert str(refused.value) == (
            "step 1 failed for a passing reason and runs again by itself once its backoff is over (attempt 2 of 3); "
            "skip_step, replace_steps or abort_plan end that wait"
        )
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].spec.input == ""  # nothing of the refused retry was kept
        assert running(d, plan.id) == [(1, 1), (2, 1)]


async def test_the_plan_view_says_a_step_waiting_out_its_backoff_runs_again_and_why(tmp_path: Path) -> None:
    # /plan showed "1. [pending] step 1" beside "2. [in_progress] step 2": as if step 2 had jumped a step that never
    # ran. It ran and failed for a passing reason; it runs again after its backoff.
    async with executor(tmp_path / "p.db") as (ex, _):
        hold_backoffs(ex)
        plan = await ex.start("c", spec(step(1), step(2, wait_for=[]), step(3, wait_for=[1])))
        await ex.complete(plan.id, 1, StepResult(ok=False, error="HTTP 429\n rate limited", transient=True), attempt=1)
        view = [line for line in (await ex.describe("c")).splitlines() if not line.startswith("   ")]
        assert (
            view[1]
            == "1. [pending] step 1 — @researcher: runs again (attempt 2 of 3) after a passing failure: HTTP 429 rate "
            "limited"
        )
        assert view[2] == "2. [in_progress] step 2 — @researcher"
        assert view[3] == "3. [pending] step 3 — @researcher"  # never ran: nothing to say


async def test_the_try_note_after_the_leads_retry_with_new_input_and_after_a_restart_counts_from_the_store(
    tmp_path: Path,
) -> None:
    path = tmp_path / "p.db"
    async with executor(path) as (ex, d):
        plan = await ex.start("c", spec(step(1, input="Find it."), step(2)))
        await ex.complete(plan.id, 1, StepResult(ok=False, error="wrong place"), attempt=1)
        await ex.retry_step("c", 1, "Look in the archive.", by="agent:kazma")
        [*_, again] = [a for a in d.actions if a.kind is ActionKind.DISPATCH]
        assert again.note == "(try 2 of 3)"
        assert again.text.startswith("Look in the archive.")
    async with executor(path) as (ex, d):  # stopped while try 2 ran: interrupted, the lead runs it again
        assert await ex.recover() == [(plan.id, 1)]
        await ex.retry_step("c", 1, None, by="agent:kazma")
        assert dispatches(d, plan.id) == [(1, 3, "(try 3 of 3)")]
        await ex.complete(plan.id, 1, StepResult(ok=False, error="HTTP 503", transient=True), attempt=3)
        assert d.asked_lead[-1] == (plan.id, 1)  # its third try was the executor's last
        await ex.retry_step("c", 1, None, by="agent:kazma")
        assert dispatches(d, plan.id)[-1] == (1, 4, "(try 4)")
