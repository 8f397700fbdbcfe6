"""One checker for every chaos cell: the invariants, checked from the outside (Jepsen's way), from what the
store holds at the end, what the platforms' fakes show and what the tool really did (its marker lines).

It never asks Kazma: it reads the store's tables through a connection of its own, the fakes' messages and
the workspace. :func:`violations` lists every broken invariant (none is the only passing answer);
:func:`ending` names how the cell ended, in the words the matrix pins; :func:`judge` gives both.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any

import psycopg

from kazma.adapters.bus import REPOSTED
from tests.chaos.rig import MARKER, History
from tests.chaos.scenario import Judged
from tests.chaos.scenario_plan import PlanHistory
from tests.chaos.scenario_swarm import SwarmHistory, told

# What a settled card says of each outcome (adapters/card_layout.py).
_OUTCOME_WORDS = {"approved": "APPROVED", "denied": "DENIED", "timeout": "TIMED OUT", "cancelled": "CANCELLED"}


@dataclass(frozen=True)
class Facts:
    requests: list[tuple[str, str, str | None, str | None]]  # id, status, decided_by, reason
    decided: dict[str, int]  # request id -> 'decided' events
    executions: list[tuple[str, str | None]]  # tool, outcome
    marker_lines: int


def rows(h: History, sql: str) -> list[tuple[Any, ...]]:
    if h.store == "postgresql":
        with psycopg.connect(h.where, autocommit=True) as conn:
            return [tuple(r) for r in conn.execute(sql).fetchall()]
    lite = sqlite3.connect(h.where)
    try:
        return [tuple(r) for r in lite.execute(sql).fetchall()]
    finally:
        lite.close()


def facts(h: History) -> Facts:
    requests = [
        (str(r[0]), str(r[1]), r[2], r[3])
        for r in rows(h, "SELECT id, status, decided_by, reason FROM approval_requests")
    ]
    decided = {
        str(r[0]): int(r[1])
        for r in rows(h, "SELECT request_id, count(*) FROM approval_events WHERE event = 'decided' GROUP BY request_id")
    }
    executions = [(str(r[0]), r[1]) for r in rows(h, "SELECT tool, outcome FROM tool_executions")]
    markers = list(h.workspace.rglob(MARKER)) if h.workspace.exists() else []
    lines = sum(len(p.read_text().splitlines()) for p in markers)
    return Facts(requests, decided, executions, lines)


def violations(h: History, f: Facts) -> list[str]:
    broken: list[str] = []
    # every request decided at most once, and exactly once if a press was answered and stands
    for rid, status, _, _ in f.requests:
        if f.decided.get(rid, 0) > 1:
            broken.append(f"request {rid} decided {f.decided[rid]} times")
        if status in ("approved", "denied") and f.decided.get(rid, 0) != 1:
            broken.append(f"request {rid} is {status} without exactly one decision recorded")
        if status == "pending":
            broken.append(f"request {rid} is still pending at the end")
    broken += card_violations(h, f)
    # no tool ran unapproved or twice
    approved = [rid for rid, status, _, _ in f.requests if status == "approved"]
    if f.marker_lines > 1:
        broken.append(f"the shell call ran {f.marker_lines} times")
    if f.marker_lines and not approved:
        broken.append("the shell call ran without an approved request")
    if f.marker_lines > len(approved):
        broken.append("more runs than approvals")
    # no inbound message lost or handled twice
    if h.asked_model > 1:
        broken.append(f"the person's message was handled {h.asked_model} times")
    # an approved call Kazma stopped before finishing says so, after the restart, on every card and in the
    # conversation: did not run (no execution started) or may have run (one started, never finished)
    if h.restarts and approved:
        words = None
        if not f.executions and not f.marker_lines:
            words = "did not run"
        elif any(outcome in ("lost", "interrupted") for _, outcome in f.executions):
            words = "may have run"
        if words is not None:
            for platform, cards in (("telegram", h.telegram_cards), ("discord", h.discord_cards)):
                if any(words not in text for text in cards):
                    broken.append(f"an approved call that {words}: a {platform} card does not say so")
            shown = set(h.telegram_cards)
            if not any(words in text for text in h.bot_texts if text not in shown):
                broken.append(f"an approved call that {words}: the conversation was not told")
    # every execution ends in a state a person can read
    if any(outcome is None for _, outcome in f.executions):
        broken.append("an execution is left neither finished nor marked lost")
    if not h.clean_exit:
        broken.append("the last process did not stop cleanly")
    return broken


def card_violations(h: History, f: Facts) -> list[str]:
    """The cards' invariants (every scenario that opens a request shares them)."""
    broken: list[str] = []
    # every card on every platform ends showing its request's outcome
    if h.telegram_live or h.discord_live:
        broken.append(f"cards still live: telegram {h.telegram_live}, discord {h.discord_live}")
    statuses = {status for _, status, _, _ in f.requests}
    for platform, cards in (("telegram", h.telegram_cards), ("discord", h.discord_cards)):
        for text in cards:
            if not any(_OUTCOME_WORDS[s] in text for s in statuses if s in _OUTCOME_WORDS):
                broken.append(f"a {platform} card does not show an outcome: {text[:120]!r}")
    # no card posted twice where the platform allows idempotency; at most once more, marked, where it does not
    per_request = max(len(f.requests), 1)
    if len(h.discord_cards) > per_request:
        broken.append(f"discord shows {len(h.discord_cards)} cards for {per_request} request(s)")
    if len(h.telegram_cards) > 2 * per_request:
        broken.append(f"telegram shows {len(h.telegram_cards)} cards for {per_request} request(s)")
    if len(h.telegram_cards) > per_request and not any(REPOSTED[:13] in t for t in h.telegram_cards):
        broken.append("a telegram card was posted again without saying so")
    return broken


def ending(h: History, f: Facts) -> str:
    """How the cell ended: the process, the request, the tool — the words the matrix pins."""
    process = "died, restarted" if h.died else "hung, killed, restarted" if h.hung else "ran on"
    if not f.requests:
        request = "no request"
    else:
        request = ", ".join(
            status + (f" ({_why(reason)})" if status in ("cancelled", "timeout") and reason else "")
            for _, status, _, reason in f.requests
        )
    tool = {0: "tool did not run", 1: "tool ran once"}.get(f.marker_lines, f"tool ran {f.marker_lines} times")
    if any(outcome in ("lost", "interrupted") for _, outcome in f.executions):
        tool += " (may have run: recorded lost)"
    reposted = " · telegram card posted again, marked" if len(h.telegram_cards) > max(len(f.requests), 1) else ""
    return f"{process} · {request} · {tool}{reposted}"


def _why(reason: str) -> str:
    return reason.split(";")[0].split(":")[0].strip()[:60]


def judge(h: History) -> Judged:
    """The approval scenario's checker: the ending and the broken invariants of one cell's history."""
    found = facts(h)
    return Judged(ending(h, found), violations(h, found), h.fired)


# -- the swarm scenario (tests/chaos/scenario_swarm.py): a task, its checkpoint card, its stages -----------------

# How often each worker's model is asked when nothing goes wrong (the builder twice: its handoff call, then the
# answer to the tool's result); more means a stage ran again by itself.
SWARM_ASKED: dict[str, int] = {"researcher": 1, "builder": 2, "validator": 1}
_TERMINAL = ("succeeded", "partial", "failed", "cancelled", "timeout", "interrupted")


def swarm_violations(h: SwarmHistory) -> list[str]:
    broken: list[str] = []
    said_texts = h.bot_texts
    # nothing admitted: the person is told nothing started
    if not h.tasks and not any("nothing started" in t or "unavailable" in t for t in said_texts):
        broken.append("no task was admitted and the person was not told")
    statuses = {task_id: status for task_id, status, _ in h.tasks}
    errors = {task_id: error for task_id, _, error in h.tasks}
    for task_id, status in statuses.items():
        # every task ends in a state a person can read: in the store, in its conversation, in `kazma swarm status`
        if status not in _TERMINAL:
            broken.append(f"task {task_id} is still {status} at the end")
            continue
        if not told(said_texts, task_id, status, errors[task_id]):
            broken.append(f"task {task_id} ended {status} and its conversation was not told")
        wrong = sorted({w for w in _TERMINAL if w != status for t in said_texts if f"swarm task {task_id} {w}" in t})
        if wrong:
            broken.append(f"task {task_id} ended {status}, and its conversation was told {', '.join(wrong)}")
        if h.status_exit != 0 or f"swarm task {task_id}: {status}" not in h.status_text:
            broken.append(f"`kazma swarm status {task_id}` does not say {status}: {h.status_text[-300:]!r}")
        # with what was kept visible: each stage's answer the journal kept, where the task is shown
        for step_task, idx, worker, ok, output in h.steps:
            if step_task == task_id and ok and status != "succeeded" and output[:40] not in h.status_text:
                broken.append(f"task {task_id} ({status}) kept stage {idx + 1} ({worker}), `swarm status` hides it")
    # a checkpoint card never stays live (nor its request pending) for an ended task
    for approval, status, by in h.checkpoints:
        task_id = by.removeprefix("swarm:")
        if status == "pending" and statuses.get(task_id) in _TERMINAL:
            broken.append(f"checkpoint {approval} still pending for task {task_id}, which ended {statuses[task_id]}")
    if h.telegram_live or h.discord_live:
        broken.append(f"cards still live: telegram {h.telegram_live}, discord {h.discord_live}")
    settled = {s for _, s, _ in h.checkpoints}
    for platform, cards in (("telegram", h.telegram_cards), ("discord", h.discord_cards)):
        for text in cards:
            if not any(_OUTCOME_WORDS[s] in text for s in settled if s in _OUTCOME_WORDS):
                broken.append(f"a {platform} checkpoint card does not show an outcome: {text[:120]!r}")
    per_request = max(len(h.checkpoints), 1)
    if len(h.discord_cards) > per_request:
        broken.append(f"discord shows {len(h.discord_cards)} cards for {per_request} checkpoint(s)")
    if len(h.telegram_cards) > 2 * per_request or (
        len(h.telegram_cards) > per_request and not any(REPOSTED[:13] in t for t in h.telegram_cards)
    ):
        broken.append(f"telegram shows {len(h.telegram_cards)} cards for {per_request} checkpoint(s), unmarked")
    # no stage ran again by itself: beyond what it asks when nothing goes wrong, only a retry its call record
    # shows (a transient failure of a call that changed nothing is retried, README "The /swarm commands")
    for worker, times in h.asked.items():
        if times > SWARM_ASKED.get(worker, 1) + h.retries.get(worker, 0):
            broken.append(f"{worker} was asked {times} times, {h.retries.get(worker, 0)} recorded as retries")
    if len(h.tasks) > 1:
        broken.append(f"one /swarm message started {len(h.tasks)} tasks")
    if not h.clean_exit:
        broken.append("the last process did not stop cleanly")
    return broken


def swarm_ending(h: SwarmHistory) -> str:
    process = "died, restarted" if h.died else "hung, killed, restarted" if h.hung else "ran on"
    task = ", ".join(f"task {status}" for _, status, _ in h.tasks) or "no task"
    checkpoint = ", ".join(f"checkpoint {status}" for _, status, _ in h.checkpoints) or "no checkpoint"
    kept = sum(1 for _, _, _, ok, _ in h.steps if ok)
    return f"{process} · {task} · {checkpoint} · {kept} stage answer(s) kept"


# -- the plan scenario (tests/chaos/scenario_plan.py): a plan, its steps, a question, a repair ----------------

# Model requests per attempt of each step when nothing goes wrong: the validator answers at once; the builder
# asks (ask_user), says it waits, and goes on with the answer.
PLAN_ASKED_PER_ATTEMPT: dict[str, tuple[int, int]] = {"validator": (1, 1), "builder": (2, 3)}  # agent: step, calls


def plan_violations(h: PlanHistory) -> list[str]:
    broken: list[str] = []
    if not h.plans:
        broken.append("no plan was written")
    for plan_id, status in h.plans:
        # every plan and step ends in a state a person can read: in the store and in /plan
        if status == "active":
            broken.append(f"plan {plan_id} is still active at the end")
        if f"Plan {plan_id} ({status})" not in h.plan_view:
            broken.append(f"/plan does not say plan {plan_id} is {status}: {h.plan_view[:200]!r}")
    for plan_id, idx, title, status, _, _ in h.steps:
        if status not in ("done", "failed", "skipped", "blocked"):
            broken.append(f"plan {plan_id} step {idx} ({title}) is still {status} at the end")
        if f"{idx}. [{status}] {title}" not in h.plan_view:
            broken.append(f"/plan does not show step {idx} ({title}) as {status}")
    # a question is answered at most once, and none stays open for a plan that ended
    ended = all(status != "active" for _, status in h.plans)
    for question, status, _ in h.questions:
        if status == "pending" and ended:
            broken.append(f"question {question} is still open for a plan that ended")
    if h.events.get("answered", 0) > len(h.questions):
        broken.append(f"{h.events['answered']} answers recorded for {len(h.questions)} question(s)")
    # no step ran again by itself: each sub-agent's model calls within what its step's attempts allow
    attempts = {idx: n for _, idx, _, _, _, n in h.steps}
    for agent, (idx, per_attempt) in PLAN_ASKED_PER_ATTEMPT.items():
        allowed = per_attempt * max(attempts.get(idx, 0), 1)
        if h.asked.get(agent, 0) > allowed:
            broken.append(f"{agent} was asked {h.asked[agent]} times for {attempts.get(idx, 0)} attempt(s) of its step")
    if h.telegram_live:
        broken.append(f"{h.telegram_live} Telegram message(s) still carry buttons")
    if not h.clean_exit:
        broken.append("the last process did not stop cleanly")
    return broken


def plan_ending(h: PlanHistory) -> str:
    process = "died, restarted" if h.died else "hung, killed, restarted" if h.hung else "ran on"
    plans = ", ".join(f"plan {status}" for _, status in h.plans) or "no plan"
    steps = ", ".join(
        f"{title} {status}" + (f" ({n} attempts)" if n > 1 else "") for _, _, title, status, _, n in h.steps
    )
    questions = ", ".join(f"question {status}" for _, status, _ in h.questions) or "no question"
    return f"{process} · {plans} · {steps or 'no steps'} · {questions}"


def swarm_judge(h: SwarmHistory) -> Judged:
    return Judged(swarm_ending(h), swarm_violations(h), h.fired)


def plan_judge(h: PlanHistory) -> Judged:
    return Judged(plan_ending(h), plan_violations(h), h.fired)
