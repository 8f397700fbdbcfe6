"""Issue 32: the swarm's failure sites carry the design's names, from one list, and every one is reachable.

``kazma.engine.swarm.metrics.FAILURE_SITES`` is the list (the README's swarm section says the same). Each site
here is driven by its real fault — a store locked or missing a table, an approvals store that cannot write,
an embeddings endpoint answering 500, a model call that fails — and its counter is seen to move.
"""

from __future__ import annotations

import ast
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from kazma.approvals import ApprovalService
from kazma.engine.swarm.metrics import DESIGN_SITES_NOT_HERE, FAILURE_SITES
from kazma.engine.swarm.patterns import Synthesis
from kazma.engine.swarm.routing import EmbeddingRouter
from kazma.engine.swarm.service import CoalescingReporter
from kazma.engine.swarm.types import ErrorKind, Pattern, TaskStatus, WorkerResult
from tests.approvals_support import RecordingPublisher, approval_service
from tests.fakes.openai import FakeOpenAI
from tests.swarm_rig import Rig, config, failures, rig
from tests.swarm_support import Locker, ScriptedWorker, store_locked

REPO = Path(__file__).resolve().parent.parent
# The design's §9 and §1.0f name these sites.
DESIGN_SITES = {
    "running_row",
    "task_write",
    "step_journal",
    "worker_metric",
    "orphan_evidence",
    "recovery_read",
    "reap",
    "idle_reap",
    "gate_register",
    "gate_settle",
    "checkpoint_timeout_arm",
    "breaker_read",
    "breaker_persist",
    "breaker_lease",
    "approval_resolve",
    "durable_workflow",
    "refiner",
    "synthesis",
    "semantic_routing",
}

CFG = """
agents:
  workers:
    a: {system_prompt: "You are a.", expertise: [alpha]}
    b: {system_prompt: "You are b.", expertise: [beta]}
pipelines: {two: [a, b]}
swarm: {retries: 0, checkpoints: {two: [1]}, workers: {b: {breaker_threshold: 1}}}
"""


def answering(name: str, *, before: Callable[[], Awaitable[None]] | None = None, ok: bool = True) -> ScriptedWorker:
    """A worker that runs ``before`` (taking or giving back a lock) and then answers."""

    def reply(prompt: str, context: str) -> WorkerResult:
        if ok:
            return WorkerResult(name, True, output=f"{name} done")
        return WorkerResult(name, False, error="upstream 503", error_kind=ErrorKind.TRANSIENT)

    worker = ScriptedWorker(name, [reply] * 5)
    if before is not None:
        original = worker.run

        async def run(prompt: str, *, context: str = "") -> WorkerResult:
            await before()
            return await original(prompt, context=context)

        worker.run = run  # type: ignore[method-assign]
    return worker


@asynccontextmanager
async def with_approvals(tmp_path: Path) -> AsyncIterator[tuple[ApprovalService, RecordingPublisher, Path]]:
    publisher = RecordingPublisher()
    path = tmp_path / "approvals.db"
    async with approval_service(
        path, config=config(CFG), publisher=publisher, busy_timeout_ms=50, poll_interval=0.01
    ) as approvals:
        yield approvals, publisher, path


async def paused_pipeline(r: Rig) -> str:
    answer = await r.send("pipeline two build it")
    task_id = answer.split()[2]
    await r.status(task_id, TaskStatus.PAUSED)
    return task_id


# -- one driver per site: each causes its fault for real ------------------------------------------------


async def running_row(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with (
        rig(path, {"a": answering("a"), "b": answering("b")}, config(CFG)) as r,
        store_locked(path),
    ):
        assert "task store unavailable" in await r.send("dispatch a go")


async def _locked_from_the_worker_on(tmp_path: Path) -> None:
    """The worker's own call takes the store's lock: its record's end, the day's numbers and the ending all fail."""
    path = tmp_path / "s.db"
    locker = Locker(path)
    async with rig(path, {"a": answering("a", before=locker.lock), "b": answering("b")}, config(CFG)) as r:
        try:
            answer = await r.send("dispatch a go")
            await r.service.wait(answer.split()[2], 30)
        finally:
            await locker.unlock()


async def step_journal(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    locker = Locker(path)
    workers = {"a": answering("a", before=locker.lock), "b": answering("b", before=locker.unlock)}
    async with rig(path, workers, config(CFG.replace("checkpoints: {two: [1]}, ", ""))) as r:
        record = await r.ended(await r.send("pipeline a,b build it"))
        assert record.status is TaskStatus.SUCCEEDED  # stage 1's journal and records were lost, not the run


async def orphan_evidence(tmp_path: Path) -> None:
    gate = asyncio.Event()
    worker = ScriptedWorker("a", gate=gate)
    async with rig(tmp_path / "s.db", {"a": worker, "b": answering("b")}, config(CFG)) as r:
        await r.service.store.conn.execute("DROP TABLE swarm_rejected_writes")  # type: ignore[union-attr]
        answer = await r.send("dispatch a go")
        task_id = answer.split()[2]
        async with asyncio.timeout(20):
            while not worker.seen:
                await asyncio.sleep(0.01)
        await r.service.store.recover()  # another process decided the run is gone: its ending is refused
        gate.set()
        record = await r.service.wait(task_id, 30)
        assert record is not None
        assert record.status is TaskStatus.INTERRUPTED


async def recovery_read(tmp_path: Path) -> None:
    async with rig(tmp_path / "s.db", {"a": answering("a"), "b": answering("b")}, config(CFG)) as r:
        async with store_locked(r.path):
            lines = await r.service.recover()
        assert any("could not be read to recover them" in line for line in lines)


async def gate_register(tmp_path: Path) -> None:
    async with (
        with_approvals(tmp_path) as (approvals, _, path),
        rig(tmp_path / "s.db", {"a": answering("a"), "b": answering("b")}, config(CFG), approvals=approvals) as r,
    ):
        async with store_locked(path):
            record = await r.ended(await r.send("pipeline two build it"))
        assert record.status is TaskStatus.FAILED
        assert "could not be opened" in (record.error or "")


async def gate_settle(tmp_path: Path) -> None:
    async with (
        with_approvals(tmp_path) as (approvals, _, path),
        rig(tmp_path / "s.db", {"a": answering("a"), "b": answering("b")}, config(CFG), approvals=approvals) as r,
    ):
        task_id = await paused_pipeline(r)
        async with store_locked(path):
            assert "cancelled by telegram:111" in await r.send(f"cancel {task_id}")


async def approval_resolve(tmp_path: Path) -> None:
    async with (
        with_approvals(tmp_path) as (approvals, _, path),
        rig(tmp_path / "s.db", {"a": answering("a"), "b": answering("b")}, config(CFG), approvals=approvals) as r,
    ):
        task_id = await paused_pipeline(r)
        async with store_locked(path):
            assert "could not be recorded" in await r.send(f"approve {task_id}")
        assert (await r.service.store.get(task_id)).status is TaskStatus.PAUSED  # type: ignore[union-attr]


async def breaker_read(tmp_path: Path) -> None:
    async with rig(tmp_path / "s.db", {"a": answering("a"), "b": answering("b")}, config(CFG)) as r:
        await r.service.store.conn.execute("DROP TABLE swarm_breakers")  # type: ignore[union-attr]
        await r.service.recover()


async def breaker_persist(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    locker = Locker(path)
    workers = {"a": answering("a"), "b": answering("b", before=locker.lock, ok=False)}
    async with rig(path, workers, config(CFG)) as r:
        try:
            answer = await r.send("dispatch b go")
            await r.service.wait(answer.split()[2], 30)
        finally:
            await locker.unlock()
        assert r.service.breakers["b"].state.value == "open"  # it works in memory; only its saving failed


async def refiner(tmp_path: Path) -> None:
    async def broken(prompt: str, results: Sequence[WorkerResult]) -> Synthesis:
        raise RuntimeError("model down")

    async with rig(tmp_path / "s.db", {"a": answering("a"), "b": answering("b")}, config(CFG)) as r:
        r.service.refiner = broken
        record = await r.ended(await r.send("pipeline a,b build it"))
        assert record.result is not None
        assert record.result["output"] == "b done"


async def synthesis(tmp_path: Path) -> None:
    async def broken(prompt: str, results: Sequence[WorkerResult]) -> Synthesis:
        raise RuntimeError("model down")

    async with rig(tmp_path / "s.db", {"a": answering("a"), "b": answering("b")}, config(CFG)) as r:
        r.service.synthesizer = broken
        record = await r.ended(await r.send("consult a,b which"))
        assert record.result is not None
        assert record.result["output"] == "[a] a done\n\n[b] b done"


async def semantic_routing(tmp_path: Path) -> None:
    async with FakeOpenAI(models=("embedder",)) as model:
        model.embeddings_error = 500
        workers = {"a": ScriptedWorker("a", expertise=("alpha",)), "b": answering("b")}
        async with rig(tmp_path / "s.db", workers, config(CFG)) as r:
            r.service.router = EmbeddingRouter(model.base_url, "embedder", deadline=5)
            record = await r.ended(await r.send("dispatch auto the alpha job"))
            assert record.request["routing"]["method"] == "keyword_fallback"


async def run(tmp_path: Path) -> None:
    broken = ScriptedWorker("a", [lambda prompt, context: None])  # type: ignore[list-item,return-value]
    async with rig(tmp_path / "s.db", {"a": broken, "b": answering("b")}, config(CFG)) as r:
        record = await r.ended(await r.send("dispatch a go"))
        assert record.status is TaskStatus.FAILED


async def report(tmp_path: Path) -> None:
    async def send(_: str) -> None:
        raise ConnectionError("home chat unreachable")

    reporter = CoalescingReporter(send, interval=0)
    reporter.add("a line")
    await reporter.close()


async def deliver(tmp_path: Path) -> None:
    async def post(target: str, text: str) -> None:
        raise ConnectionError(f"{target} unreachable")

    async with rig(tmp_path / "s.db", {"a": answering("a"), "b": answering("b")}, config(CFG)) as r:
        r.service.deliver = post
        record = await r.ended(await r.send("dispatch a go -> web:ops"))  # the console: always served
        assert record.status is TaskStatus.SUCCEEDED


async def retention(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with (
        rig(path, {"a": answering("a"), "b": answering("b")}, config(CFG)) as r,
        store_locked(path),
    ):
        assert await r.service.sweep_retention() == 0


async def retry_ask(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with rig(path, {"a": answering("a"), "b": answering("b")}, config(CFG)) as r:
        record = await r.ended(await r.send("dispatch a go"))
        run = await r.service.store.admit(Pattern.DISPATCH, record.request, owner="telegram:111")
        await r.service.store.step(run, "a")
        await r.service.store.recover()  # interrupted: its retry must be asked twice, the first ask kept
        async with store_locked(path):
            assert "unavailable" in await r.send(f"retry {run.task_id}")


DRIVERS: dict[str, Callable[[Path], Awaitable[None]]] = {
    "running_row": running_row,
    "task_write": _locked_from_the_worker_on,
    "step_journal": step_journal,
    "worker_metric": _locked_from_the_worker_on,
    "orphan_evidence": orphan_evidence,
    "recovery_read": recovery_read,
    "gate_register": gate_register,
    "gate_settle": gate_settle,
    "approval_resolve": approval_resolve,
    "breaker_read": breaker_read,
    "breaker_persist": breaker_persist,
    "refiner": refiner,
    "synthesis": synthesis,
    "semantic_routing": semantic_routing,
    "run": run,
    "report": report,
    "deliver": deliver,
    "retention": retention,
    "retry_ask": retry_ask,
}


def test_the_sites_are_the_designs_each_one_here_or_said_why_not() -> None:
    assert set(FAILURE_SITES) & set(DESIGN_SITES_NOT_HERE) == set()
    assert set(FAILURE_SITES) | set(DESIGN_SITES_NOT_HERE) >= DESIGN_SITES
    assert set(DESIGN_SITES_NOT_HERE) <= DESIGN_SITES  # "not here" is only said of the design's own sites
    readme = (REPO / "README.md").read_text()
    for site in [*FAILURE_SITES, *DESIGN_SITES_NOT_HERE]:
        assert f"`{site}`" in readme, f"the README's swarm section does not name {site}"


def test_every_site_has_a_driver() -> None:
    assert set(DRIVERS) == set(FAILURE_SITES)


def test_every_counted_site_in_the_engine_is_a_listed_one() -> None:
    named: set[str] = set()
    for path in (REPO / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "swarm_failure":
                (argument,) = node.args
                assert isinstance(argument, ast.Constant), f"{path}: swarm_failure takes a site name literally"
                named.add(str(argument.value))
    assert named == set(FAILURE_SITES)


@pytest.mark.parametrize("site", list(FAILURE_SITES))
async def test_each_site_is_reachable(tmp_path: Path, site: str) -> None:
    before = failures(site)
    await DRIVERS[site](tmp_path)
    assert failures(site) > before, f"driving {site} did not count it"
