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
