"""Chaos scenarios among two ``kazma run`` replicas on one PostgreSQL (what only a leader does, and who does it):

- ``takeover``: replica A leads; a person asks in Telegram and A's lead opens an approval, its cards out; A is
  killed (SIGKILL: the leader dies) and B, armed, takes the lease and reaches the point there. Whoever leads
  in the end must finish A's work once: the request ends (a press on the live card, or the recovery of what
  A left), every card settles once, nothing runs unapproved, the message is not handled again.
- ``claim``: a person writes to the lead in Discord; the leader (A, armed) holds the gateway and claims the
  message at the point; B follows. Invariants: the message is claimed by one replica and answered once, never
  lost, never handled twice.

On SQLite there is one process: no lease, no takeover, no claims (each scenario's ``left_out`` says so).
"""

from __future__ import annotations

import asyncio
import json
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from tests.chaos.checker import judge as judge_approval
from tests.chaos.checker import rows
from tests.chaos.doors import HELLO, HELLO_ANSWER, base_fields, process_words
from tests.chaos.rig import (
    ASK,
    DONE,
    MARKER,
    STEP_SECONDS,
    TG_ADMIN,
    TG_CHAT,
    History,
    Rig,
    RigError,
    _connected,
    _drive_approval,
    _recovered,
    _stop,
    _until,
    fakes,
    history,
    observe,
)
from tests.chaos.scenario import Cell, Judged, Scenario
from tests.fakes.discord import HOME_CHANNEL_ID
from tests.fakes.openai import Completion, FakeToolCall

A: Final = "chaos-a"
B: Final = "chaos-b"
_ONE_PROCESS: Final = (
    "one process on SQLite holds no lease and claims nothing (bot/app.py: replication, leader duties and inbound "
    "claims exist only among PostgreSQL replicas), so the point is never reached"
)


def _procs(*procs: asyncio.subprocess.Process | None) -> list[asyncio.subprocess.Process]:
    return [p for p in procs if p is not None]


async def _started(s: Rig, proc: asyncio.subprocess.Process, before: int) -> bool:
    """Serving (as a follower: no platform connection of its own): it said ``app.started``."""
    return await _until(lambda: s.started() > before, proc, 60)


async def _stop_all(h: History, *procs: asyncio.subprocess.Process) -> None:
    """Every process still running asked to stop; ``h.clean_exit`` false when one did not stop cleanly."""
    for proc in procs:
        if proc.returncode is None:
            clean = await _stop(proc, signal.SIGTERM) and proc.returncode == 0
            h.clean_exit = h.clean_exit and clean


# -- takeover: the leader dies, the other takes the lease at the point ---------------------------------------


async def _run_takeover(tmp: Path, cell: Cell, dsn: str | None) -> History:
    point, action, store = cell
    s = Rig(tmp, store=store, dsn=dsn)
    h = history(tmp, point, action, store, dsn)
    a = b = None
    async with fakes(s):
        s.model.script(
            Completion(tool_calls=(FakeToolCall("shell", json.dumps({"command": f"echo ran >> {MARKER}"})),)),
            Completion(content=DONE),
        )
        try:
            a = await s.start("", replica=A)
            if not await _connected(s, a, 0, 0, 0):
                raise RigError(f"replica A never came up leading: {s.log_tail()}")
            b = await s.start(f"{point}={action}", replica=B)
            if not await _started(s, b, 1):
                raise RigError(f"replica B never came up: {s.log_tail()}")
            s.telegram.push_message(TG_CHAT, TG_ADMIN, ASK, username="ops")
            # A dies once both cards are out and recorded (a card posted and not yet recorded is the cells of
            # bus.post.recorded; here the takeover is what is faulted)
            if not await _until(lambda: len(rows(h, _RECORDED)) >= 2, a, STEP_SECONDS):
                raise RigError(f"the lead on replica A never had its call's cards out: {s.log_tail()}")
            polls, identifies, started = len(s.telegram.calls_to("getUpdates")), len(s.discord.identifies), s.started()
            await _stop(a, signal.SIGKILL)  # the leader dies, the call's waiter with it
            h.restarts = 1  # the process waiting for the request is gone: an approval must say the call did not run
            # B takes the lease (the point), leads, ends what A left; the person presses the card still live
            settled = await _drive_approval(s, b, h, False)
            if b.returncode is not None:
                h.died = True
            elif not settled:
                h.hung = True
                await _stop(b, signal.SIGKILL)
            if h.died or h.hung:
                recovered = s.recovered()
                b = await s.start("", replica=B)  # as an operator would: B again, without the failpoint
                if not await _connected(s, b, polls, identifies, started):
                    raise RigError(f"replica B, restarted, never came up leading: {s.log_tail()}")
                await _recovered(s, b, recovered)
                await _drive_approval(s, b, h, False)
            # what A left is judged once A has been missing longer than the lease's takeover bound: the leader
            # says then, on every card, what became of the call (or the call ran); wait for it, bounded
            await _until(lambda: _ended(s, h), b, 2 * STEP_SECONDS)
            await _stop_all(h, b)
        finally:
            for proc in _procs(a, b):
                if proc.returncode is None:
                    await _stop(proc, signal.SIGKILL)
        h.fired = '"failpoint.fired"' in s.log.read_text(errors="replace")
        observe(s, h)
    return h


_RECORDED: Final = "SELECT platform FROM approval_cards WHERE platform IN ('telegram', 'discord')"
_SAID: Final = ("did not run", "may have run", "CANCELLED", "DENIED", "TIMED OUT")


def _ended(s: Rig, h: History) -> bool:
    """Every card settled and saying what became of its request (it ended unapproved, the call ran, or the card
    says that it did not run or may have run: then the conversation was told so too)."""
    if s.tg_live() or s.dc_live():
        return False
    if h.workspace.exists() and any(h.workspace.rglob(MARKER)):
        return True
    cards = [str(m.text) for m in s.tg_cards()]  # type: ignore[attr-defined]
    if not all(any(words in text for words in _SAID) for text in cards):
        return False
    told = [m.text for m in s.telegram.bot_messages(TG_CHAT) if m.text not in cards]
    return all(any(words in text for text in told) for words in _SAID[:2] if any(words in c for c in cards))


TAKEOVER: Final = Scenario(
    name="takeover",
    points=("leader.takeover",),
    drive=_run_takeover,
    judge=judge_approval,
    left_out={"sqlite": _ONE_PROCESS},
)


# -- claim: the leader claims a Discord message at the point ---------------------------------------------


@dataclass
class ClaimHistory(History):
    answers: int = 0  # the lead's answers to the message, in the Discord channel
    key: str = ""  # the person's message's claim key


def _discord_answers(s: Rig) -> int:
    return sum(HELLO_ANSWER in str(m.get("content") or "") for m in s.discord.channel_messages(HOME_CHANNEL_ID))


async def _run_claim(tmp: Path, cell: Cell, dsn: str | None) -> ClaimHistory:
    point, action, _ = cell
    s = Rig(tmp, store=cell[2], dsn=dsn)
    h = ClaimHistory(**base_fields(tmp, cell, dsn))
    a = b = None
    async with fakes(s):
        s.model.script(Completion(content=HELLO_ANSWER))
        try:
            a = await s.start(f"{point}={action}", replica=A)
            if not await _connected(s, a, 0, 0, 0):
                raise RigError(f"replica A never came up leading: {s.log_tail()}")
            b = await s.start("", replica=B)
            if not await _started(s, b, 1):
                raise RigError(f"replica B never came up: {s.log_tail()}")
            sent = await s.discord.user_message(HOME_CHANNEL_ID, HELLO, mentions=[s.discord.bot])
            h.key = f"message:{sent['id']}"
            # answered by whoever leads, within the bound (B: once A is gone and B holds the gateway)
            answered = await _until(lambda: _discord_answers(s) > 0, b, 2 * STEP_SECONDS)
            if a.returncode is not None:
                h.died = True
            elif not answered:
                h.hung = True
                await _stop(a, signal.SIGKILL)
                await _until(lambda: _discord_answers(s) > 0, b, STEP_SECONDS)
            if h.died or h.hung:
                h.restarts = 1
                started = s.started()
                a = await s.start("", replica=A)  # as an operator would: A again, without the failpoint
                if not await _started(s, a, started):
                    raise RigError(f"replica A, restarted, never came up: {s.log_tail()}")
            await _stop_all(h, *_procs(a, b))
        finally:
            for proc in _procs(a, b):
                if proc.returncode is None:
                    await _stop(proc, signal.SIGKILL)
        h.fired = '"failpoint.fired"' in s.log.read_text(errors="replace")
        observe(s, h, ask=HELLO)
        h.answers = _discord_answers(s)
    return h


def _judge_claim(h: ClaimHistory) -> Judged:
    broken: list[str] = []
    if h.answers == 0:
        broken.append("the person's message was lost: the lead never answered")
    if h.answers > 1:
        broken.append(f"the lead answered one message {h.answers} times")
    if h.asked_model > 1:
        broken.append(f"the person's message was handled {h.asked_model} times")
    claims = [r for r in rows(h, "SELECT event_key, replica, done_at FROM inbound_claims") if r[0] == h.key]
    if len(claims) > 1:
        broken.append(f"one message claimed {len(claims)} times")
    if any(done is None for _, _, done in claims) and h.answers:
        broken.append("the message was answered, its claim never marked taken in")
    if not h.clean_exit:
        broken.append("a replica did not stop cleanly")
    said = {0: "not answered", 1: "answered once"}.get(h.answers, f"answered {h.answers} times")
    by = f" by {claims[0][1]}" if len(claims) == 1 and h.answers else ""
    return Judged(f"{process_words(h)} · {said}{by}", broken, h.fired)


CLAIM: Final = Scenario(
    name="claim",
    points=("inbound.claim",),
    drive=_run_claim,
    judge=_judge_claim,
    left_out={"sqlite": _ONE_PROCESS},
)
