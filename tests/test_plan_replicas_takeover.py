"""A plan whose replica died between two of its writes is moved on by the survivor, once the owner is gone.

Real ``kazma run`` replicas on the wire fakes and a real PostgreSQL. Replica A leads (it polls Telegram), so the
person's ask and the plan run there; A is killed (SIGKILL, ``plan.complete=crash``) right after step 1's failure
is committed and before the lead is asked about it. B takes the lease, judges A gone once A has been missing
longer than the lease's takeover bound, takes A's plan over (bot/lifecycle.py's sweep, engine/executor.py) and
asks the lead: the plan is repaired, the person's question answered, and it finishes — each step handed out and
the lead asked about the failure exactly once.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from tests.chaos.rig import STEP_SECONDS, _connected, _stop, _until, fakes
from tests.chaos.scenario_plan import ASK, SUMMED, PlanRig, prompts
from tests.chaos.scenario_swarm import rows
from tests.fakes.telegram import FakeTelegram
from tests.pg_support import find_bindir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_bindir() is None, reason="no PostgreSQL server binaries"),
]
TG_CHAT = -1001
TG_ADMIN = 111


def _lead_asked_to_decide(s: PlanRig) -> int:
    lead = prompts()["kazma"]
    return sum(
        str(r.body["messages"][0].get("content")) == lead
        and "Decide what to do next" in str(r.body["messages"][-1].get("content") or "")
        for r in s.model.completions
    )


def _said(telegram: FakeTelegram, words: str) -> int:
    return sum(words in m.text for m in telegram.bot_messages(TG_CHAT))


async def test_a_plan_left_idle_by_a_killed_replica_is_moved_on_once_by_the_survivor(
    tmp_path: Path, pg_dsn: str
) -> None:
    s = PlanRig(tmp_path, store="postgresql", dsn=pg_dsn)
    procs: list[asyncio.subprocess.Process] = []
    async with fakes(s):
        s.script_agents()
        try:
            a = await s.start("plan.complete=crash", replica="plans-a")
            procs.append(a)
            assert await _connected(s, a, 0, 0, 0), s.log_tail()
            b = await s.start("", replica="plans-b")
            procs.append(b)
            assert await _until(lambda: s.started() > 1, b, 60), s.log_tail()

            s.telegram.push_message(TG_CHAT, TG_ADMIN, ASK, username="ops")
            assert await _until(lambda: a.returncode is not None, b, 2 * STEP_SECONDS), "A never reached the point"
            assert a.returncode == -signal.SIGKILL
            # step 1's failure committed, nobody asked: the plan idle, left by a replica that is gone
            assert rows("postgresql", pg_dsn, "SELECT status FROM plans") == [("active",)]

            # B leads; once A counts as gone it takes the plan over; the person answers the builder's question
            loop = asyncio.get_running_loop()
            end = loop.time() + 3 * STEP_SECONDS
            while not s.ended() and loop.time() < end and b.returncode is None:
                for question in s.open_questions(restarted=True):
                    s.answer(question)
                await asyncio.sleep(0.05)
            assert s.ended(), s.log_tail()
            assert await _until(lambda: _said(s.telegram, SUMMED) > 0, b, STEP_SECONDS)
            assert await _stop(b, signal.SIGTERM)
            assert b.returncode == 0
        finally:
            for proc in procs:
                if proc.returncode is None:
                    await _stop(proc, signal.SIGKILL)
    assert rows("postgresql", pg_dsn, "SELECT owner, status FROM plans") == [("plans-b", "finished")]
    steps = rows("postgresql", pg_dsn, "SELECT idx, status, attempts FROM plan_steps ORDER BY idx")
    assert steps == [(1, "done", 2), (2, "done", 1)]  # step 1 repaired once; nothing handed out twice
    assert rows("postgresql", pg_dsn, "SELECT status FROM plan_questions") == [("answered",)]
    assert _lead_asked_to_decide(s) == 1  # A died before asking; B asked once
    assert _said(s.telegram, SUMMED) == 1
