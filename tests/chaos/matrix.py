"""The chaos matrix: point x action x store -> the ending pinned for it (tests/chaos/test_matrix.py runs it,
``scripts/chaos`` prints it).

Every cell runs the scenario that crosses its point (:mod:`tests.chaos.scenarios`; the first, of
:mod:`tests.chaos.rig`, an approved shell call across Telegram and Discord) with that one failpoint armed,
and the scenario's checker (for that one, :mod:`tests.chaos.checker`) must find no invariant broken. A
cell's ending is pinned here once it has been looked at and judged right; a cell with no entry runs, is
printed with its ending, and fails as "not pinned". ``KNOWN_BROKEN`` holds cells whose ending breaks an
invariant today, with why: they are expected to fail until fixed (strict: a fix makes them pass, and the
entry must then move to ``PINNED``); ``SOMETIMES_BROKEN`` those broken only under some timings; ``LEFT_OUT``
the cells a scenario does not run on a store, with why.
"""

from __future__ import annotations

from typing import Final

from tests.chaos import matrix_tasks
from tests.chaos.scenarios import APPROVAL, SCENARIOS

# The failpoints the approval scenario crosses, in the order it reaches them.
SCENARIO_POINTS: Final = APPROVAL.points
ACTIONS: Final = ("crash", "error", "hang", "delay:300")
STORES: Final = ("sqlite", "postgresql")

_RESTART = "died, restarted"
# What a restart says of a request its previous life left pending: one process on its SQLite file, or the
# replica (restarted under its own name) on PostgreSQL.
_CANCELLED: Final = {
    "sqlite": "cancelled (Kazma restarted before a decision)",
    "postgresql": "cancelled (the Kazma replica waiting for it stopped before a decision)",
}

# After the decision commits, the waiting call is woken while the cards settle: the tool may start before a
# crash in the settle (or before the presser is answered). Both orders are right, and each is said right: the
# call did not run, or its row says it may have run (started, not finished), or — when the crashing edit is a
# slower platform's, after the call had run and its ending was written — it ran once, recorded.
_RACED = (
    f"{_RESTART} · approved · tool did not run",
    f"{_RESTART} · approved · tool did not run (may have run: recorded lost)",
    f"{_RESTART} · approved · tool ran once (may have run: recorded lost)",
    f"{_RESTART} · approved · tool ran once",
)

Ending = str | tuple[str, ...]

# crash: the process SIGKILLs itself at the point, and is started again. The same on both stores ({cancelled}:
# what the restart says of a request left pending, _CANCELLED).
CRASH: Final[dict[str, Ending]] = {
    "approvals.open.row": f"{_RESTART} · no request · tool did not run",
    "approvals.open.card_job": f"{_RESTART} · no request · tool did not run",
    "approvals.open.committed": f"{_RESTART} · {{cancelled}} · tool did not run",
    "bus.post": f"{_RESTART} · {{cancelled}} · tool did not run",
    # the card posted, its message id never recorded: Discord finds it again by its nonce at the restart, a
    # press on the Telegram one edits it to the outcome (the request ended: the press decides nothing). The
    # restart serves before it cancels its orphans: when its card worker gets there first, Telegram (no nonce)
    # shows the card once more, marked "Posted again", and it settles with the rest.
    "bus.post.recorded": (
        f"{_RESTART} · {{cancelled}} · tool did not run",
        f"{_RESTART} · {{cancelled}} · tool did not run · telegram card posted again, marked",
    ),
    "approvals.decide.before_commit": f"{_RESTART} · {{cancelled}} · tool did not run",
    # decided, then the process died before the call ran: the approval stands, the call never runs by itself
    "approvals.decide.after_commit": f"{_RESTART} · approved · tool did not run",
    "approvals.decide.before_answer": _RACED,
    "bus.settle.sent": _RACED,
    "bus.settle.recorded": _RACED,
    "tools.verified": f"{_RESTART} · approved · tool did not run",
    # the execution's row was committed before the tool: after the crash it reads "may have run"
    "tools.started": f"{_RESTART} · approved · tool did not run (may have run: recorded lost)",
    "tools.finished": f"{_RESTART} · approved · tool ran once (may have run: recorded lost)",
    "tools.recorded": f"{_RESTART} · approved · tool ran once",
}

# error: each point raises the error its real failure raises there (the store's, the platform's); the same on
# both stores.
ERROR: Final[dict[str, Ending]] = {
    # the opening transaction fails: nothing is open, the asker is told, nothing runs
    "approvals.open.row": "ran on · no request · tool did not run",
    "approvals.open.card_job": "ran on · no request · tool did not run",
    # committed, then the asker's call fails: nobody will wait for the request, so it is cancelled there and
    # then (its cards settle, the asker is told why), and no press can approve it
    "approvals.open.committed": "ran on · cancelled (opening it failed after it was written) · tool did not run",
    # a platform's 503 on the post, the store refusing its record (tried again): the card is out, the call runs
    "bus.post": "ran on · approved · tool ran once",
    "bus.post.recorded": "ran on · approved · tool ran once",
    # the press is not recorded and the presser is told to press again; the rig does not, so the request waits
    # until the process is killed as stuck, and the restart cancels it
    "approvals.decide.before_commit": "hung, killed, restarted · {cancelled} · tool did not run",
    # the decision committed before the error: it stands, the presser is told so, the waiter is woken at once
    # (on PostgreSQL it polls only every 30 s) and the call runs once
    "approvals.decide.after_commit": "ran on · approved · tool ran once",
    "approvals.decide.before_answer": "ran on · approved · tool ran once",
    # an edit refused (retried) or its record refused: the card settles, the call runs
    "bus.settle.sent": "ran on · approved · tool ran once",
    "bus.settle.recorded": "ran on · approved · tool ran once",
    # the execution's row cannot be written: the call does not run; the tool cannot start: it did not run
    "tools.verified": "ran on · approved · tool did not run",
    "tools.started": "ran on · approved · tool did not run",
    # the tool ran; its ending's write failed (tried again) or its result's: it ran once, never again
    "tools.finished": "ran on · approved · tool ran once",
    "tools.recorded": "ran on · approved · tool ran once",
}

_HUNG = "hung, killed, restarted"
_ON = "ran on · approved · tool ran once"
_POST_HUNG = (f"{_HUNG} · {{cancelled}} · tool did not run", _ON)

# hang: the point never returns. The rig calls the process stuck when, within its bound, the person's ask brings
# neither a card nor an answer, a card stays live, or the cards settle and the person never hears back; it is
# killed and started again. The same on both stores.
HANG: Final[dict[str, Ending]] = {
    # the asker's call never opens (or its transaction never commits): nothing is open; the restart finds nothing
    "approvals.open.row": f"{_HUNG} · no request · tool did not run",
    "approvals.open.card_job": f"{_HUNG} · no request · tool did not run",
    # committed, the asker stuck: its cards are posted from the outbox and the press approves it, with nobody
    # waiting; after the kill the restart says on every card and in the conversation that it did not run
    "approvals.open.committed": f"{_HUNG} · approved · tool did not run",
    # a post (or its record) that never returns, on whichever platform reaches it first: Telegram's, and no card
    # can be pressed, the request waits until the kill and the restart cancels it; Discord's, and the Telegram
    # card is pressed, the call runs, and the Discord card is never posted (two runs saw each)
    "bus.post": _POST_HUNG,
    "bus.post.recorded": _POST_HUNG,
    # the press never commits: the restart cancels the request
    "approvals.decide.before_commit": f"{_HUNG} · {{cancelled}} · tool did not run",
    # committed, the presser never answered: the waiter reads the decision at its poll, the cards settle at the
    # bus's scan, the call runs once
    "approvals.decide.after_commit": _ON,
    "approvals.decide.before_answer": _ON,
    # an edit that never returns leaves its card live until the kill (the call ran); or the bus's scan edits
    # that card again meanwhile (each card's edit counted in memory since i31/wake-settle: seen once on SQLite)
    # and nothing is stuck; its record never written: the card shows the outcome already
    "bus.settle.sent": (f"{_HUNG} · approved · tool ran once", _ON),
    "bus.settle.recorded": _ON,
    # the execution stuck before its row, before the tool (its row reads "may have run" after the kill), after
    # the tool (ran, its ending lost: may have run), or on its way back to the model (ran, recorded)
    "tools.verified": f"{_HUNG} · approved · tool did not run",
    "tools.started": f"{_HUNG} · approved · tool did not run (may have run: recorded lost)",
    "tools.finished": f"{_HUNG} · approved · tool ran once (may have run: recorded lost)",
    "tools.recorded": f"{_HUNG} · approved · tool ran once",
}

# delay:300: every point a little late; nothing changes, on either store.
DELAY: Final[dict[str, Ending]] = dict.fromkeys(SCENARIO_POINTS, _ON)


def _on(store: str, ending: Ending) -> Ending:
    if isinstance(ending, str):
        return ending.format(cancelled=_CANCELLED[store])
    return tuple(e.format(cancelled=_CANCELLED[store]) for e in ending)


_APPROVAL_PINNED: Final[dict[tuple[str, str, str], Ending]] = (
    {
        (point, action, store): _on(store, ending)
        for store in STORES
        for action, column in (("crash", CRASH), ("error", ERROR))
        for point, ending in column.items()
    }
    | {
        # hang and delay:300 on PostgreSQL (a replica, restarted under its name): every cell ended as on SQLite,
        # {cancelled} in the replica's words, no invariant broken (a full run of both columns, each ending looked
        # at; bus.post=hang ended "ran on": the Discord post hung, one of the two endings seen on SQLite)
        (point, action, store): _on(store, ending)
        for store in STORES
        for action, column in (("hang", HANG), ("delay:300", DELAY))
        for point, ending in column.items()
    }
    | {
        # PostgreSQL's writer runs a pipelined group that failed again statement by statement (i31/pg-thin): the
        # point fires once, so the card job's refused write is written on that second run and the request opens
        # (each error that recurs still reaches its own operation)
        ("approvals.open.card_job", "error", "postgresql"): _ON,
    }
)

# The scenarios of tests/chaos/doors.py and tests/chaos/replicas.py: one point each, (action, store) -> ending.
_TOLD = "approved · client told approved"
OTHERS: Final[dict[str, dict[tuple[str, str], Ending]]] = {
    # the request committed with its key, the client not answered: after a dropped connection (the process
    # died, or the client's own timeout ran out on a hung answer) or a 503 it asks again with the key and is
    # given the same request; a person approves it on Telegram; the client is told
    "api.open": {
        **{("crash", store): f"{_RESTART} · {_TOLD} (dropped, 200)" for store in STORES},
        **{("error", store): f"ran on · {_TOLD} (503, 200)" for store in STORES},
        **{("hang", store): f"ran on · {_TOLD} (dropped, 200)" for store in STORES},
        **{("delay:300", store): f"ran on · {_TOLD} (201)" for store in STORES},
    },
    # kept in the inbox, not confirmed to Telegram: the restart takes it over from the inbox (Telegram gives it
    # again too, and the claim lets it through once); an inbox write refused: the poll fails and asks again
    "telegram.inbox": {
        ("crash", "postgresql"): f"{_RESTART} · answered once (taken over from the inbox)",
        ("error", "postgresql"): "ran on · answered once",
        ("delay:300", "postgresql"): "ran on · answered once",
        # the poll stuck with the update kept: killed as stuck, the restart takes it over from the inbox
        ("hang", "postgresql"): "hung, killed, restarted · answered once (taken over from the inbox)",
    },
    # A, the leader waiting for the call, killed with its cards out; B takes the lease at the point: crashing
    # there (restarted), its duties failing (it gives the lease up and takes it again), stuck (killed,
    # restarted) or late, B leads, the person's press approves the call nobody waits for, and once A counts as
    # gone B says on every card and in the conversation that it did not run
    "leader.takeover": {
        ("crash", "postgresql"): f"{_RESTART} · approved · tool did not run",
        ("error", "postgresql"): "ran on · approved · tool did not run",
        ("hang", "postgresql"): "hung, killed, restarted · approved · tool did not run",
        ("delay:300", "postgresql"): "ran on · approved · tool did not run",
    },
    # a claim's error is let through (the platform was told it arrived): handled here. The leader dying at its
    # claim (or stuck there, killed): the message was kept with the claim, and B, leading once A is gone, takes
    # the claim over and hands it over once (Discord's gateway never delivers it again)
    "inbound.claim": {
        ("error", "postgresql"): "ran on · answered once by chaos-a",
        ("delay:300", "postgresql"): "ran on · answered once by chaos-a",
        ("crash", "postgresql"): f"{_RESTART} · answered once by chaos-b",
        ("hang", "postgresql"): "hung, killed, restarted · answered once by chaos-b",
    },
}

PINNED: Final[dict[tuple[str, str, str], Ending]] = (
    _APPROVAL_PINNED
    | {(point, action, store): ending for point, column in OTHERS.items() for (action, store), ending in column.items()}
    | dict[tuple[str, str, str], Ending](matrix_tasks.PINNED)  # the plan, swarm and MCP scenarios' cells
)

KNOWN_BROKEN: Final[dict[tuple[str, str, str], str]] = dict(matrix_tasks.KNOWN_BROKEN)

# Broken only when the timing falls a certain way (seen under load, not alone): expected to fail sometimes.
SOMETIMES_BROKEN: Final[dict[tuple[str, str, str], str]] = {}


# Cells that never run: a store the scenario's point is not reached on (the scenario's ``left_out``), with why.
LEFT_OUT: Final[dict[tuple[str, str, str], str]] = {
    (point, action, store): why
    for scenario in SCENARIOS
    for store, why in scenario.left_out.items()
    for action in ACTIONS
    for point in scenario.points
}


def cells() -> list[tuple[str, str, str]]:
    return [
        (point, action, store)
        for store in STORES
        for action in ACTIONS
        for scenario in SCENARIOS
        for point in scenario.points
        if (point, action, store) not in LEFT_OUT
    ]


# CI runs the whole crash column on SQLite (every scenario's points, about 20 s a cell, by scripts/check's own
# chaos step, six cells at a time) and, on PostgreSQL, the three whose ending rests on a restarted replica ending
# what its previous life left (a card found again by its nonce and cancelled, an approved call said not to have
# run, an execution said to have maybe run). The rest: KAZMA_CHAOS=all or scripts/chaos.
CI: Final = frozenset(
    [cell for cell in cells() if cell[1:] == ("crash", "sqlite")]
    + [
        (point, "crash", "postgresql")
        for point in ("bus.post.recorded", "approvals.decide.after_commit", "tools.started")
    ]
)
