"""The failpoints module: what ``KAZMA_FAILPOINTS`` may say, what each action does, and that it is read at start."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kazma.config import failpoints
from kazma.config.failpoints import POINTS, FailpointSpecError, parse

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def disarmed() -> Iterator[None]:
    yield
    failpoints.disarm()


def test_actions_and_counts_parse() -> None:
    armed = parse("bus.post=error, tools.started=crash,swarm.handoff=delay:250,mcp.call=3*hang")
    assert {n: (a.action, a.delay_ms, a.times) for n, a in armed.items()} == {
        "bus.post": ("error", 0, 1),
        "tools.started": ("crash", 0, 1),
        "swarm.handoff": ("delay", 250, 1),
        "mcp.call": ("hang", 0, 3),
    }


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("bus.psot=crash", "no failpoint named 'bus.psot'"),
        ("bus.post", "is not name=action"),
        ("bus.post=explode", "the action must be one of crash, error, hang, delay"),
        ("bus.post=delay", "delay needs milliseconds"),
        ("bus.post=crash:5", "crash takes no argument"),
        ("bus.post=0*crash", "the count before '*' must be a positive number"),
    ],
)
def test_a_wrong_spec_says_what_is_wrong(spec: str, says: str) -> None:
    with pytest.raises(FailpointSpecError, match=re.escape(says)):
        parse(spec)


async def test_a_point_fires_once_with_its_sites_error_then_is_spent(disarmed: None) -> None:
    failpoints.arm_for_test("bus.post=error")
    assert failpoints.armed
    with pytest.raises(sqlite3.OperationalError, match="disk I/O"):
        await failpoints.reached("bus.post", lambda: sqlite3.OperationalError("disk I/O error"))
    await failpoints.reached("bus.post", lambda: sqlite3.OperationalError("disk I/O error"))  # spent
    await failpoints.reached("tools.started")  # not armed: nothing


async def test_hang_never_returns_until_cancelled_and_delay_returns(disarmed: None) -> None:
    failpoints.arm_for_test("mcp.call=hang,swarm.handoff=delay:30")
    hung = asyncio.create_task(failpoints.reached("mcp.call"))
    await failpoints.reached("swarm.handoff")
    assert not hung.done()
    hung.cancel()
    with pytest.raises(asyncio.CancelledError):
        await hung


def test_a_synchronous_point_without_a_named_error_raises_failpoint_error(disarmed: None) -> None:
    failpoints.arm_for_test("approvals.open.row=2*error")
    for _ in range(2):
        with pytest.raises(failpoints.FailpointError):
            failpoints.reached_sync("approvals.open.row")
    failpoints.reached_sync("approvals.open.row")  # spent after two


def test_unset_means_disarmed_and_a_bad_variable_is_refused_at_start() -> None:
    def run(value: str | None, code: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != failpoints.ENV}
        if value is not None:
            env[failpoints.ENV] = value
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)

    shown = "from kazma.config import failpoints as f; print(f.armed, f.check())"
    assert run(None, shown).stdout.split() == ["False", "[]"]
    assert run("bus.post=delay:5", shown).stdout.strip() == "True ['bus.post=delay:5']"
    refused = run("bus.psot=crash", shown)
    assert refused.returncode != 0
    assert "no failpoint named 'bus.psot'" in refused.stderr


def test_crash_kills_the_process_at_once_after_saying_so() -> None:
    code = (
        "import asyncio; from kazma.config import failpoints as f\n"
        "print('before', flush=True)\n"
        "asyncio.run(f.reached('tools.started'))\n"
        "print('after', flush=True)\n"
    )
    env = {**os.environ, failpoints.ENV: "tools.started=crash"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == -signal.SIGKILL
    assert done.stdout == "before\n"
    assert '"event": "failpoint.fired"' in done.stderr
    assert '"failpoint": "tools.started"' in done.stderr


def test_every_point_has_a_call_site() -> None:
    """A point nobody reaches would pass every chaos cell without injecting anything."""
    source = "\n".join(
        p.read_text(encoding="utf-8")
        for layer in ("config", "approvals", "adapters", "engine", "bot")
        for p in (REPO / layer).rglob("*.py")
        if p.name != "failpoints.py"
    )
    # the name as a site's argument (``reached("x"``, ``reached_sync(``, the executor's ``_at(``), not any string:
    # "mcp.call" was also a log event's name, and that passed this check with no site at all
    sites = set(re.findall(r'(?:reached|reached_sync|_at)\(\s*"([a-z_.]+)"', source))
    missing = sorted(name for name in POINTS if name not in sites)
    assert missing == []
