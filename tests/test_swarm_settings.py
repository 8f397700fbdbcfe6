"""Issue 32: every swarm setting does what kazma.yaml says, per worker over the swarm's, and `config check` says so.

``swarm.retries`` used to be ignored (three calls whatever it said) and the backoff was 2 retries at 0.5–30 s;
the design's policy is 3 retries, 1 s doubling to 60 s, with jitter, through the one :class:`Backoff`.
No test sleeps: the service's sleep and jitter are injected and the waits are recorded.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kazma.config import ConfigError, load_config_text
from kazma.engine.swarm.types import ErrorKind, TaskStatus, WorkerResult
from tests.swarm_rig import Sleeps, config, rig
from tests.swarm_support import ScriptedWorker

WORKERS = """
agents:
  workers:
    a: {system_prompt: "You are a."}
    b: {system_prompt: "You are b."}
pipelines: {}
"""


def flaky(name: str) -> ScriptedWorker:
    """A worker whose every answer is a transient failure: how many times it is asked is the retry count."""
    failure = WorkerResult(name, False, error="upstream 503", error_kind=ErrorKind.TRANSIENT)
    return ScriptedWorker(name, [failure] * 20)


@pytest.mark.parametrize(("retries", "calls"), [(0, 1), (2, 3), (5, 6)])
async def test_swarm_retries_sets_how_many_times_a_worker_is_called(tmp_path: Path, retries: int, calls: int) -> None:
    worker = flaky("a")
    cfg = config(WORKERS + f"swarm: {{retries: {retries}, breaker_threshold: 100}}\n")
    async with rig(tmp_path / "s.db", {"a": worker, "b": flaky("b")}, cfg) as r:
        record = await r.ended(await r.send("dispatch a go"))
        assert record.status is TaskStatus.FAILED
        assert len(worker.seen) == calls


async def test_a_workers_own_retries_override_the_swarms(tmp_path: Path) -> None:
    a, b = flaky("a"), flaky("b")
    cfg = config(WORKERS + "swarm: {retries: 5, breaker_threshold: 100, workers: {b: {retries: 0}}}\n")
    async with rig(tmp_path / "s.db", {"a": a, "b": b}, cfg) as r:
        await r.ended(await r.send("dispatch a go"))
        await r.ended(await r.send("dispatch b go"))
    assert (len(a.seen), len(b.seen)) == (6, 1)


async def test_the_default_policy_is_the_designs_three_retries_from_one_second_capped_at_sixty(tmp_path: Path) -> None:
    sleeps = Sleeps()
    worker = flaky("a")
    async with rig(tmp_path / "s.db", {"a": worker, "b": flaky("b")}, config(WORKERS), sleep=sleeps) as r:
        await r.ended(await r.send("dispatch a go"))
    assert len(worker.seen) == 4
    assert sleeps.delays == [1.0, 2.0, 4.0]  # jitter drawn at its top (rng 1.0): the nominal delays


async def test_backoff_is_capped_and_jittered_by_the_configured_values(tmp_path: Path) -> None:
    sleeps = Sleeps()
    cfg = config(WORKERS + "swarm: {retries: 8, breaker_threshold: 100}\n")
    async with rig(tmp_path / "s.db", {"a": flaky("a"), "b": flaky("b")}, cfg, sleep=sleeps, rng=lambda: 0.0) as r:
        await r.ended(await r.send("dispatch a go"))
    # equal jitter at its bottom: half of 1, 2, 4, … doubling, never past half of the 60 s cap
    assert sleeps.delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    sleeps.delays.clear()
    cfg = config(WORKERS + "swarm: {retries: 3, retry_base_seconds: 2, retry_cap_seconds: 5, retry_jitter: false}\n")
    async with rig(tmp_path / "t.db", {"a": flaky("a"), "b": flaky("b")}, cfg, sleep=sleeps, rng=lambda: 0.0) as r:
        await r.ended(await r.send("dispatch a go"))
    assert sleeps.delays == [2.0, 4.0, 5.0]


async def test_a_workers_own_timeout_and_breaker_override_the_swarms(tmp_path: Path) -> None:
    cfg = config(
        WORKERS + "swarm: {step_timeout_seconds: 300, breaker_threshold: 5, breaker_cooldown_seconds: 60,"
        " workers: {b: {timeout_seconds: 7, breaker_threshold: 2, breaker_cooldown_seconds: 9, max_concurrent: 3}}}\n"
    )
    a, b = cfg.swarm.reliability("a"), cfg.swarm.reliability("b")
    assert (a.timeout_seconds, a.breaker_threshold, a.breaker_cooldown_seconds, a.max_concurrent) == (300, 5, 60, None)
    assert (b.timeout_seconds, b.breaker_threshold, b.breaker_cooldown_seconds, b.max_concurrent) == (7, 2, 9, 3)
    async with rig(tmp_path / "s.db", {"a": flaky("a"), "b": flaky("b")}, cfg) as r:
        breaker = r.service.breakers["b"]
        assert (breaker.failure_threshold, breaker.cooldown) == (2, 9)
        assert r.service.breakers["a"].failure_threshold == 5


def test_config_check_prints_each_workers_effective_settings(tmp_path: Path) -> None:
    path = tmp_path / "kazma.yaml"
    path.write_text(
        WORKERS + "swarm: {retries: 4, task_concurrency: 3, max_parallel_workers: 40,"
        " workers: {b: {retries: 1, timeout_seconds: 20, breaker_threshold: 2, max_concurrent: 2}}}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", "config", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = {line.split(":", 1)[0].strip(): line for line in done.stdout.splitlines() if line.startswith("    ")}
    assert lines["a"].strip() == (
        "a: retries 4 (backoff 1 s doubling to 60 s, jitter), timeout 300 s, breaker 5 failures then 60 s rest, "
        "concurrency no limit of its own, 3 per task, 40 in the process"
    )
    assert lines["b"].strip() == (
        "b: retries 1 (backoff 1 s doubling to 60 s, jitter), timeout 20 s, breaker 2 failures then 60 s rest, "
        "concurrency at most 2 at once, 3 per task, 40 in the process"
    )


def test_the_old_routing_floor_is_refused_naming_its_replacement() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config_text("swarm: {routing_floor: 0.3}\n")
    assert caught.value.lines == [
        "kazma.yaml: swarm.routing_floor: replaced by swarm.routing_margin: semantic routing takes the best worker "
        "only when it leads the runner-up by the margin (default 0.045), and refuses ambiguous tasks"
    ]
