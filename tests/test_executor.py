from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kazma.config.database import open_database
from kazma.engine.executor import INTERRUPTED, Action, ActionKind, DispatchFailed, PlanExecutor, StepResult
from kazma.engine.plan import OnFailure, PlanError, PlanSpec, StepSpec, StepStatus, dependencies, validate_plan
from kazma.engine.plan_store import MIGRATIONS, PlanStore, TransitionError

WORKERS = {"researcher", "builder", "validator"}


@dataclass
class RecordingDispatcher:
    store: PlanStore
    actions: list[Action] = field(default_factory=list)
    outstanding: list[tuple[str, int, int]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    fail_next: DispatchFailed | None = None

    async def perform(self, action: Action) -> None:
        self.actions.append(action)
        if action.kind in (ActionKind.DISPATCH, ActionKind.RUN_LEAD, ActionKind.ASK_USER):
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
            self.outstanding.append((action.plan.id, action.step.index, action.step.attempts))

    def dispatched(self) -> list[tuple[str, int]]:
        return [
            (a.plan.id, a.step.index)
            for a in self.actions
            if a.step is not None and a.kind in (ActionKind.DISPATCH, ActionKind.RUN_LEAD, ActionKind.ASK_USER)
        ]


def last_kind(d: RecordingDispatcher) -> ActionKind:
    return d.actions[-1].kind


@asynccontextmanager
async def executor(path: Path) -> AsyncIterator[tuple[PlanExecutor, RecordingDispatcher]]:
    conn = await open_database(path, migrations=MIGRATIONS)
    store = PlanStore(conn)
    dispatcher = RecordingDispatcher(store)
    try:
        yield PlanExecutor(store, dispatcher, lead_name="kazma", assignees=WORKERS), dispatcher
    finally:
        await conn.close()


def spec(*steps: StepSpec) -> PlanSpec:
    return PlanSpec(goal="ship it", steps=list(steps))


def step(index: int, assignee: str = "researcher", **kw: object) -> StepSpec:
    return StepSpec(index=index, title=f"step {index}", assignee=assignee, **kw)  # type: ignore[arg-type]


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


async def test_linear_plan_renders_summaries_into_later_inputs(tmp_path: Path) -> None:
    async with executor(tmp_path / "p.db") as (ex, d):
        plan = await ex.start(
            "telegram:-1",
            spec(
                step(1, "researcher", input="find sources"),
                step(2, "builder", input="build from: {{step_1.output_summary}}"),
            ),
        )
        assert [(a.kind, a.text) for a in d.actions] == [(ActionKind.DISPATCH, "find sources")]
        await ex.complete(plan.id, 1, StepResult(ok=True, summary="three good sources"))
        assert last_kind(d) is ActionKind.DISPATCH
        rendered = d.actions[-1].text
        assert rendered.startswith("build from: \n[Untrusted data from step 1 (researcher)")
        assert "\nthree good sources\n" in rendered
        await ex.complete(plan.id, 2, StepResult(ok=True, summary="built"))
        assert last_kind(d) is ActionKind.FINISHED
        assert await ex.store.plan_status(plan.id) == "finished"


async def test_user_and_lead_steps(tmp_path: Path) -> None:
    async with executor(tmp_path / "p.db") as (ex, d):
        plan = await ex.start("web:c", spec(step(1, "user", input="which region?"), step(2, "kazma")))
        assert last_kind(d) is ActionKind.ASK_USER
        await ex.complete(plan.id, 1, StepResult(ok=True, summary="eu-west"))
        assert last_kind(d) is ActionKind.RUN_LEAD


async def test_failure_policies(tmp_path: Path) -> None:
    async with executor(tmp_path / "p.db") as (ex, d):
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
        assert loaded.steps[2].status is StepStatus.BLOCKED
        assert loaded.steps[3].status is StepStatus.IN_PROGRESS  # independent work goes on
        ask = [a for a in d.actions if a.kind is ActionKind.ASK_LEAD]
        assert len(ask) == 1
        assert ask[0].text == "Step 1 failed: no access"


async def test_transient_failures_retry_up_to_the_cap(tmp_path: Path) -> None:
    async with executor(tmp_path / "p.db") as (ex, d):
        plan = await ex.start("c", spec(step(1)))
        for _ in range(3):
            await ex.complete(plan.id, 1, StepResult(ok=False, error="HTTP 503", transient=True))
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.FAILED
        assert loaded.steps[1].attempts == 3
        assert d.dispatched() == [(plan.id, 1)] * 3


async def test_dispatch_that_cannot_be_posted_is_a_failure_not_a_hang(tmp_path: Path) -> None:
    async with executor(tmp_path / "p.db") as (ex, d):
        d.fail_next = DispatchFailed("telegram answered 403", transient=False)
        plan = await ex.start("c", spec(step(1)))
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.FAILED
        assert "dispatch failed: telegram answered 403" in loaded.steps[1].failure_reason


async def test_stale_and_duplicate_completions_change_nothing(tmp_path: Path) -> None:
    async with executor(tmp_path / "p.db") as (ex, d):
        plan = await ex.start("c", spec(step(1), step(2)))
        assert not await ex.complete(plan.id, 2, StepResult(ok=True, summary="I did step 2 early"))
        results = await asyncio.gather(*(ex.complete(plan.id, 1, StepResult(ok=True, summary="x")) for _ in range(5)))
        assert sorted(results) == [False, False, False, False, True]
        assert d.dispatched() == [(plan.id, 1), (plan.id, 2)]


async def test_answer_from_an_earlier_attempt_is_stale(tmp_path: Path) -> None:
    async with executor(tmp_path / "p.db") as (ex, d):
        plan = await ex.start("c", spec(step(1)))
        assert await ex.complete(plan.id, 1, StepResult(ok=False, error="503", transient=True), attempt=1)
        assert d.actions[-1].step is not None
        assert d.actions[-1].step.attempts == 2
        assert not await ex.complete(plan.id, 1, StepResult(ok=True, summary="late from attempt 1"), attempt=1)
        assert await ex.complete(plan.id, 1, StepResult(ok=True, summary="attempt 2"), attempt=2)
        loaded = await ex.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].output_summary == "attempt 2"


async def test_terminal_states_are_never_left(tmp_path: Path) -> None:
    async with executor(tmp_path / "p.db") as (ex, _):
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
        assert loaded.steps[1].failure_reason == INTERRUPTED
        assert loaded.steps[2].status is StepStatus.BLOCKED
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
        outcomes[index] = draw(st.sampled_from(["ok", "ok", "ok", "fail", "transient"]))
    return PlanSpec(goal="g", steps=steps), outcomes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=st.lists(plans(), min_size=1, max_size=3), seed=st.integers(0, 2**32 - 1))
def test_random_plans_random_orders_never_dispatch_twice_or_early(
    tmp_path_factory: pytest.TempPathFactory, drawn: list[tuple[PlanSpec, dict[int, str]]], seed: int
) -> None:
    asyncio.run(_drive(tmp_path_factory.mktemp("prop") / "p.db", drawn, random.Random(seed)))


async def _drive(path: Path, drawn: list[tuple[PlanSpec, dict[int, str]]], rng: random.Random) -> None:
    async with executor(path) as (ex, d):
        conversations = ["c1", "c1", "c2"]  # two plans may share a conversation (and its lock)
        started = await asyncio.gather(*(ex.start(conversations[i], p) for i, (p, _) in enumerate(drawn)))
        outcome_of = {plan.id: outcomes for plan, (_, outcomes) in zip(started, drawn, strict=True)}
        transient_budget = {(plan.id, i): 1 for plan in started for i in plan.steps}
        for _ in range(500):
            if not d.outstanding:
                break
            rng.shuffle(d.outstanding)
            batch, d.outstanding[:] = d.outstanding[:2], d.outstanding[2:]
            calls = []
            for plan_id, index, attempt in batch:
                kind = outcome_of[plan_id][index]
                if kind == "transient" and transient_budget[(plan_id, index)] > 0:
                    transient_budget[(plan_id, index)] -= 1
                    result = StepResult(ok=False, error="timeout", transient=True)
                elif kind == "fail":
                    result = StepResult(ok=False, error="boom")
                else:
                    result = StepResult(ok=True, summary=f"done {index}")
                # the same answer twice at once, as a duplicate delivery would give
                calls += [ex.complete(plan_id, index, result, attempt=attempt) for _ in range(2)]
            await asyncio.gather(*calls)
        assert d.outstanding == []
        assert d.violations == []
        counts: dict[tuple[str, int], int] = {}
        for key in d.dispatched():
            counts[key] = counts.get(key, 0) + 1
        for (plan_id, index), count in counts.items():
            allowed = 2 if outcome_of[plan_id][index] == "transient" else 1
            assert count <= allowed, f"step {index} of {plan_id} dispatched {count} times"
        for plan in started:
            loaded = await ex.store.load(plan.id)
            assert loaded is not None
            assert all(s.status.terminal for s in loaded.steps.values()), {i: s.status for i, s in loaded.steps.items()}
