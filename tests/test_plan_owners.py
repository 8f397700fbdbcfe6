"""Plans among replicas: each plan is owned by the replica driving it, and a plan left idle is repaired only by a
survivor that takes it over from an owner that is gone — one survivor, never while the owner lives.

Three replicas' executors on one store (their own connections). Replica a drives a plan and stops between two
writes, the way a SIGKILL leaves it (a step's ending committed and the plan not moved on; a person's answer
committed and the step not resumed). While a lives nobody touches its plan (its lead may be deciding); once it
is gone, b and c judge what it left at the same moment and exactly one moves each plan on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from kazma.config.store.backend import StoreConnection
from kazma.config.store.database import open_database
from kazma.config.store.postgres import open_pg_store
from kazma.engine.executor import ActionKind, PlanExecutor
from kazma.engine.plan import PlanOrigin, PlanSpec, StepSpec, StepStatus
from kazma.engine.plan_store import MIGRATIONS, PG_MIGRATIONS, PlanStore
from tests.store_backends import Engine
from tests.test_executor import WORKERS, RecordingDispatcher

REQUESTER = "telegram:111"
Replica = tuple[PlanExecutor, RecordingDispatcher]


@pytest.fixture
async def replicas(store_engine: Engine) -> AsyncIterator[dict[str, Replica]]:
    async with AsyncExitStack() as stack:
        found: dict[str, Replica] = {}
        for name in ("a", "b", "c"):
            conn: StoreConnection
            if store_engine.name == "postgresql":
                conn = await open_pg_store(store_engine.where, migrations=PG_MIGRATIONS, application_name=name)
            else:
                conn = await open_database(store_engine.where, migrations=MIGRATIONS)
            stack.push_async_callback(conn.close)
            store = PlanStore(conn, replica=name)
            dispatcher = RecordingDispatcher(store)
            found[name] = (PlanExecutor(store, dispatcher, lead_name="kazma", assignees=WORKERS), dispatcher)
        yield found


def _plan() -> PlanSpec:
    return PlanSpec(
        goal="ship it",
        steps=[
            StepSpec(index=1, title="check", assignee="validator", input="check"),
            StepSpec(index=2, title="deploy", assignee="builder", input="deploy", wait_for=[1]),
        ],
    )


async def test_an_idle_plan_is_moved_on_once_by_one_survivor_and_never_while_its_owner_lives(
    replicas: dict[str, Replica],
) -> None:
    (a, _), (b, on_b), (c, on_c) = replicas["a"], replicas["b"], replicas["c"]
    plan = await a.start("telegram:-1", _plan(), PlanOrigin("ship it", REQUESTER))
    assert await a.store.owner(plan.id) == "a"
    # a records step 1's ending and dies before moving the plan on (what plan.complete=crash leaves)
    assert await a.store.set_status(plan.id, 1, StepStatus.IN_PROGRESS, StepStatus.DONE, output_summary="ok")

    _, told = await b.mark_interrupted({"a", "b", "c"})
    assert told == []  # a lives: the plan is a's to move on
    assert await a.store.owner(plan.id) == "a"

    (_, by_b), (_, by_c) = await asyncio.gather(b.mark_interrupted({"b", "c"}), c.mark_interrupted({"b", "c"}))
    await asyncio.gather(b.perform(by_b), c.perform(by_c))
    dispatched = on_b.dispatched() + on_c.dispatched()
    assert dispatched == [(plan.id, 2)]  # one survivor hands step 2 out, once
    winner = "b" if on_b.dispatched() else "c"
    assert await a.store.owner(plan.id) == winner
    loaded = await a.store.load(plan.id)
    assert loaded is not None
    assert loaded.steps[2].status is StepStatus.IN_PROGRESS
    assert loaded.steps[2].attempts == 1

    # judged again (the next sweep): the plan is the winner's now, and it lives
    _, again = await b.mark_interrupted({"b", "c"})
    assert again == []


async def test_an_answer_taken_by_a_replica_that_died_before_resuming_is_resumed_once_by_a_survivor(
    replicas: dict[str, Replica],
) -> None:
    (a, on_a), (b, on_b), (c, on_c) = replicas["a"], replicas["b"], replicas["c"]
    plan = await a.start(
        "telegram:-1",
        PlanSpec(goal="ship it", steps=[StepSpec(index=1, title="region", assignee="user", input="which region?")]),
        PlanOrigin("ship it", REQUESTER),
    )
    [question] = await a.open_questions("telegram:-1")
    # b takes the person's answer (a press or a reply reached it) and dies before resuming the step
    assert await b.store.settle_question(question.id, "answered", answer="eu-west", actor=REQUESTER)
    assert await a.store.owner(plan.id) == "b"

    _, told = await c.mark_interrupted({"a", "b", "c"})
    assert told == []  # b lives: the answer is b's to go on with
    (_, by_a), (_, by_c) = await asyncio.gather(a.mark_interrupted({"a", "c"}), c.mark_interrupted({"a", "c"}))
    await asyncio.gather(a.perform(by_a), c.perform(by_c))
    finished = [x.plan.id for x in on_a.actions + on_c.actions if x.kind is ActionKind.FINISHED]
    assert finished == [plan.id]  # the answer taken once: the step done with it, the plan finished once
    loaded = await a.store.load(plan.id)
    assert loaded is not None
    assert loaded.steps[1].status is StepStatus.DONE
    assert loaded.steps[1].output_summary == "eu-west"
    assert loaded.status == "finished"
    assert on_b.actions == []
