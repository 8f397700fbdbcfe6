"""Issue 32: the design's concurrency — 5 calls per task under one process-wide cap of 64 — and resumes that go
through the same capacity check as new tasks (not pending / at capacity / not recorded).

The running count is sampled from inside the workers themselves, with a counter only the event loop touches;
no test waits on time: calls are held until the cap is reached, then let go.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kazma.approvals.model import Decision
from kazma.engine.swarm.types import TaskStatus, WorkerResult
from tests.approvals_support import RecordingPublisher, approval_service
from tests.swarm_rig import config, rig
from tests.swarm_support import ScriptedWorker

NAMES = [f"w{i}" for i in range(8)]
WORKERS = "agents:\n  workers:\n" + "".join(f'    {n}: {{system_prompt: "You are {n}."}}\n' for n in NAMES)


@dataclass
class Gauge:
    """How many calls are inside workers now, at most so far, and per task; ``full`` once ``hold`` are inside."""

    hold: int
    running: int = 0
    peak: int = 0
    per_task: Counter[str] = field(default_factory=Counter)
    task_peaks: Counter[str] = field(default_factory=Counter)
    full: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class CountingWorker:
    name: str
    gauge: Gauge
    expertise: tuple[str, ...] = ()

    async def run(self, prompt: str, *, context: str = "") -> WorkerResult:
        g = self.gauge
        g.running += 1
        g.per_task[prompt] += 1
        g.peak = max(g.peak, g.running)
        g.task_peaks[prompt] = max(g.task_peaks[prompt], g.per_task[prompt])
        try:
            if g.running >= g.hold and not g.full.is_set():
                # let go only after every call already able to run has had its turn to come in (call_soon
                # queues the release behind them): a limit that is missing shows as a peak above ``hold``
                asyncio.get_running_loop().call_soon(g.full.set)
            await g.full.wait()  # held until the cap is reached: every slot the limits allow is taken
            return WorkerResult(self.name, True, output=f"{self.name} on {prompt}")
        finally:
            g.running -= 1
            g.per_task[prompt] -= 1


async def test_a_hundred_tasks_of_eight_calls_never_run_more_than_64_calls_and_5_per_task(tmp_path: Path) -> None:
    gauge = Gauge(hold=64)
    workers = {n: CountingWorker(n, gauge) for n in NAMES}
    cfg = config(WORKERS + "pipelines: {}\nswarm: {max_parallel: 100, task_concurrency: 5, max_parallel_workers: 64}\n")
    async with rig(tmp_path / "s.db", workers, cfg) as r:
        answers = await asyncio.gather(*(r.send(f"fanout {','.join(NAMES)} task {i}") for i in range(100)))
        records = [await r.ended(answer) for answer in answers]
    assert all(record.status is TaskStatus.SUCCEEDED for record in records)
    assert gauge.peak == 64  # the cap was reached (the workers waited for it) and never passed
    assert max(gauge.task_peaks.values()) <= 5
    assert sum(1 for record in records for _ in (record.result or {})["workers"]) == 800


async def test_one_task_runs_exactly_its_per_task_limit_at_once(tmp_path: Path) -> None:
    gauge = Gauge(hold=5)
    workers = {n: CountingWorker(n, gauge) for n in NAMES}
    async with rig(tmp_path / "s.db", workers, config(WORKERS + "pipelines: {}\n")) as r:
        record = await r.ended(await r.send(f"fanout {','.join(NAMES)} one task"))
    assert record.status is TaskStatus.SUCCEEDED
    assert gauge.task_peaks["one task"] == 5


def gated(name: str) -> tuple[ScriptedWorker, asyncio.Event]:
    gate = asyncio.Event()
    return ScriptedWorker(name, gate=gate), gate


CHECKPOINTED = """
agents:
  workers:
    a: {system_prompt: "You are a."}
    b: {system_prompt: "You are b."}
    slow: {system_prompt: "You are slow."}
pipelines: {two: [a, b]}
swarm: {max_parallel: 1, checkpoints: {two: [1]}}
"""


async def test_approving_at_capacity_answers_at_capacity_and_resumes_nothing(tmp_path: Path) -> None:
    slow, release = gated("slow")
    workers = {"a": ScriptedWorker("a"), "b": ScriptedWorker("b"), "slow": slow}
    cfg = config(CHECKPOINTED)
    publisher = RecordingPublisher()
    async with (
        approval_service(tmp_path / "ap.db", config=cfg, publisher=publisher, poll_interval=0.01) as approvals,
        rig(tmp_path / "s.db", workers, cfg, approvals=approvals) as r,
    ):
        paused = (await r.send("pipeline two build it")).split()[2]
        await r.status(paused, TaskStatus.PAUSED)
        running = (await r.send("dispatch slow take your time")).split()[2]  # the one slot is taken
        assert "at capacity" in await r.send("dispatch a another")

        answer = await r.send(f"approve {paused}")
        assert answer.startswith("Not approved: the swarm is at capacity (1 of 1 tasks running)")
        assert "checkpoint stays open" in answer
        (card,) = publisher.published
        request = await approvals.store.get(card.request_id)
        assert request is not None
        assert request.outcome() is None  # not decided: the checkpoint is still pending
        assert (await r.service.store.get(paused)).status is TaskStatus.PAUSED  # type: ignore[union-attr]

        release.set()
        assert (await r.ended(f"swarm task {running}")).status is TaskStatus.SUCCEEDED
        assert (await r.send(f"approve {paused}")).startswith("Approved.")
        assert (await r.ended(f"swarm task {paused}")).status is TaskStatus.SUCCEEDED
        assert workers["b"].seen  # it ran once there was room


async def test_a_card_approved_while_the_swarm_is_full_resumes_when_a_task_ends(tmp_path: Path) -> None:
    slow, release = gated("slow")
    workers = {"a": ScriptedWorker("a"), "b": ScriptedWorker("b"), "slow": slow}
    cfg = config(CHECKPOINTED)
    publisher = RecordingPublisher()
    async with (
        approval_service(tmp_path / "ap.db", config=cfg, publisher=publisher, poll_interval=0.01) as approvals,
        rig(tmp_path / "s.db", workers, cfg, approvals=approvals) as r,
    ):
        paused = (await r.send("pipeline two build it")).split()[2]
        await r.status(paused, TaskStatus.PAUSED)
        running = (await r.send("dispatch slow take your time")).split()[2]
        (card,) = publisher.published
        press = await approvals.decide_from_button(
            card.button_data(Decision.APPROVE), actor="telegram:111", platform="telegram"
        )
        assert press.won  # a decided approval is final: it waits for room instead of being handed back
        await r.said(f"swarm task {paused} was approved, but the swarm is at capacity")
        assert (await r.service.store.get(paused)).status is TaskStatus.PAUSED  # type: ignore[union-attr]
        assert workers["b"].seen == []
        release.set()
        assert (await r.ended(f"swarm task {running}")).status is TaskStatus.SUCCEEDED
        assert (await r.ended(f"swarm task {paused}")).status is TaskStatus.SUCCEEDED
        assert len(workers["b"].seen) == 1


async def test_approving_a_task_that_is_not_paused_says_so(tmp_path: Path) -> None:
    slow, release = gated("slow")
    cfg = config(CHECKPOINTED.replace("max_parallel: 1", "max_parallel: 4"))
    async with (
        approval_service(tmp_path / "ap.db", config=cfg, poll_interval=0.01) as approvals,
        rig(tmp_path / "s.db", {"a": ScriptedWorker("a"), "b": ScriptedWorker("b"), "slow": slow}, cfg,
            approvals=approvals) as r,
    ):  # fmt: skip
        running = (await r.send("dispatch slow go")).split()[2]
        answer = await r.send(f"approve {running}")
        assert answer == f"swarm task {running} is not waiting at a checkpoint (it is running); nothing changed"
        release.set()
        await r.ended(f"swarm task {running}")
