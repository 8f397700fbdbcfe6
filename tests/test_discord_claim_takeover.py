"""A Discord message claimed by the leader that dies before taking it in is handed over once by the next leader.

Discord's gateway delivers a message once, to the session connected when it was sent: a leader that claimed it
and died (SIGKILL, at the claim) took it with it, and the next leader's gateway never sees it. The claim keeps
the message (bot/inbound_claims.py, adapters/discord/adapter.py), so the replica that takes over hands it over,
and only it: real ``kazma run`` replicas on the wire fakes and a real PostgreSQL.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import psycopg
import pytest

from tests.chaos.doors import HELLO, HELLO_ANSWER
from tests.chaos.rig import STEP_SECONDS, Rig, _connected, _stop, _until, fakes
from tests.fakes.discord import HOME_CHANNEL_ID
from tests.fakes.openai import Completion
from tests.pg_support import find_bindir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_bindir() is None, reason="no PostgreSQL server binaries"),
]


def _answers(s: Rig) -> int:
    return sum(HELLO_ANSWER in str(m.get("content") or "") for m in s.discord.channel_messages(HOME_CHANNEL_ID))


def _asked(s: Rig) -> int:
    """Model requests whose last message is the person's: one per handling of the message."""
    return sum(HELLO in str((r.body.get("messages") or [{}])[-1].get("content") or "") for r in s.model.completions)


def _claims(dsn: str, key: str) -> list[tuple[str, float | None, str | None]]:
    with psycopg.connect(dsn) as conn:
        cur = conn.execute(
            "SELECT replica, done_at, payload FROM inbound_claims WHERE platform = 'discord' AND event_key = %s",
            (key,),
        )
        return [(str(r[0]), r[1], r[2]) for r in cur.fetchall()]


def _said(s: Rig, event: str) -> int:
    return s.log.read_text(errors="replace").count(f'"event": "{event}"') if s.log.exists() else 0


async def test_a_message_claimed_by_a_leader_killed_at_its_claim_is_answered_once_by_the_next(
    tmp_path: Path, pg_dsn: str
) -> None:
    s = Rig(tmp_path, store="postgresql", dsn=pg_dsn)
    procs: list[asyncio.subprocess.Process] = []
    async with fakes(s):
        s.model.script(Completion(content=HELLO_ANSWER))
        try:
            a = await s.start("inbound.claim=crash", replica="claims-a")  # SIGKILL to itself once it claimed
            procs.append(a)
            assert await _connected(s, a, 0, 0, 0), s.log_tail()
            b = await s.start("", replica="claims-b")
            procs.append(b)
            assert await _until(lambda: s.started() > 1, b, 60), s.log_tail()

            sent = await s.discord.user_message(HOME_CHANNEL_ID, HELLO, mentions=[s.discord.bot])
            key = f"message:{sent['id']}"
            assert await _until(lambda: a.returncode is not None, b, STEP_SECONDS), "A never reached its claim"
            assert a.returncode == -signal.SIGKILL
            [(holder, done, _)] = _claims(pg_dsn, key)
            assert (holder, done) == ("claims-a", None)  # claimed by A, never taken in: the gateway won't resend

            # B takes the lease, its gateway never sees the message; the claim it takes over hands it over
            assert await _until(lambda: _answers(s) > 0, b, 2 * STEP_SECONDS), s.log_tail()
            assert await _until(lambda: _said(s, "discord.kept_handed_over") >= 1, b, STEP_SECONDS)
            [(holder, done, payload)] = _claims(pg_dsn, key)
            assert holder == "claims-b"
            assert done is not None
            assert payload is None  # the message was kept only until it was taken in

            # B stops; A, started again, leads and looks at what is kept: nothing is handed over twice
            identifies, handed = len(s.discord.identifies), _said(s, "discord.kept_handed_over")
            assert await _stop(b, signal.SIGTERM)
            assert b.returncode == 0
            a = await s.start("", replica="claims-a")
            procs.append(a)
            assert await _until(lambda: len(s.discord.identifies) > identifies, a, 60), s.log_tail()
            assert await _until(lambda: _said(s, "discord.kept_handed_over") > handed, a, STEP_SECONDS)
            await s.discord.user_message(HOME_CHANNEL_ID, "@kazma anything else?", mentions=[s.discord.bot])
            assert await _until(lambda: len(s.model.completions) >= 2, a, STEP_SECONDS)  # the next one is handled
            assert await _stop(a, signal.SIGTERM)
            assert a.returncode == 0
        finally:
            for proc in procs:
                if proc.returncode is None:
                    await _stop(proc, signal.SIGKILL)
        assert _answers(s) == 1, s.discord.channel_messages(HOME_CHANNEL_ID)
        assert _asked(s) == 1
