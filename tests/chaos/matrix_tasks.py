"""The endings pinned for the plan, swarm and MCP scenarios' cells (:mod:`tests.chaos.matrix` joins them to
its own): point x action x store -> ending, in the words of :func:`tests.chaos.checker.plan_ending`,
:func:`~tests.chaos.checker.swarm_ending` and :func:`~tests.chaos.checker.ending`."""

from __future__ import annotations

from typing import Final

_RESTART = "died, restarted"

# -- the swarm scenario: /swarm pipeline quick (researcher, checkpoint, builder -> handoff -> validator) ---------

# crash: the process dies at the point; the restart calls a task it left running interrupted (said in the
# conversation with the stage it stopped in, the journal's answers kept and shown); a paused one waits again.
SWARM_CRASH: Final[dict[str, str]] = {
    # on disk RUNNING, nothing started: interrupted, nothing kept, nothing re-ran
    "swarm.admitted": f"{_RESTART} · task interrupted · no checkpoint · 0 stage answer(s) kept",
    "swarm.step.started": f"{_RESTART} · task interrupted · no checkpoint · 0 stage answer(s) kept",
    # the researcher answered, its journal entry not written: its answer is lost with the process, said so
    "swarm.step.finished": f"{_RESTART} · task interrupted · no checkpoint · 0 stage answer(s) kept",
    # the card and the paused row are one transaction: it died, neither is there; stage 1's answer is kept
    "swarm.checkpoint.card": f"{_RESTART} · task interrupted · no checkpoint · 1 stage answer(s) kept",
    # card and paused row committed: the restart waits at the checkpoint again, the card (still live) is
    # pressed, the task resumes and succeeds
    "swarm.checkpoint.paused": f"{_RESTART} · task succeeded · checkpoint approved · 2 stage answer(s) kept",
    # approved and RUNNING again, the next stage not started (or its handoff not called): interrupted, stage 1 kept
    "swarm.resumed": f"{_RESTART} · task interrupted · checkpoint approved · 1 stage answer(s) kept",
    "swarm.handoff": f"{_RESTART} · task interrupted · checkpoint approved · 1 stage answer(s) kept",
    # every stage journaled, the ending not stored: interrupted, both stages' answers kept and shown
    "swarm.result.stored": f"{_RESTART} · task interrupted · checkpoint approved · 2 stage answer(s) kept",
}

# error: each point raises the error its real failure raises there (the swarm store's, a model call's).
SWARM_ERROR: Final[dict[str, str]] = {
    # the RUNNING row written, then refused: the row ends failed ("not started"), the person is told nothing
    # started, nothing runs
    "swarm.admitted": "ran on · task failed · no checkpoint · 0 stage answer(s) kept",
    # a worker call failing (transient) is retried, recorded as a retry; its journal write failing likewise
    "swarm.step.started": "ran on · task succeeded · checkpoint approved · 2 stage answer(s) kept",
    "swarm.step.finished": "ran on · task succeeded · checkpoint approved · 2 stage answer(s) kept",
    # the checkpoint's card and paused row not written (one transaction): the task fails, stage 1's answer
    # kept and shown
    "swarm.checkpoint.card": "ran on · task failed · no checkpoint · 1 stage answer(s) kept",
    # the wait for the decision fails: the task fails and its card is withdrawn (cancelled on every platform)
    "swarm.checkpoint.paused": "ran on · task failed · checkpoint cancelled · 1 stage answer(s) kept",
    # the resumed step's record not written: the run goes on
    "swarm.resumed": "ran on · task succeeded · checkpoint approved · 2 stage answer(s) kept",
    # the handoff's target call fails as a model's: stage 2 fails, the pipeline with it, stage 1 kept and shown
    "swarm.handoff": "ran on · task failed · checkpoint approved · 1 stage answer(s) kept",
    # the ending refused by the store: kept, said, and stored when the store answers
    "swarm.result.stored": "ran on · task succeeded · checkpoint approved · 2 stage answer(s) kept",
}

# -- the MCP scenario: tracker/create_issue over stdio, approved on Telegram -----------------------------------

MCP_CRASH: Final = {
    # the execution's row was committed before the call: after the crash it reads "may have run", on every card
    # and in the conversation; the server never got the call
    "mcp.call": f"{_RESTART} · approved · tool did not run (may have run: recorded lost)",
}
MCP_ERROR: Final = {
    # the server's stream breaks before the call: the server is restarted, the call answered "may or may not
    # have acted"; it did not reach the server
    "mcp.call": "ran on · approved · tool did not run",
}

# -- the plan scenario ----------------------------------------------------------------------------------------

_DONE = "plan finished · check done (2 attempts), deploy done · question answered"  # the repair, the answer: all ran

# crash: the restart fails a step left running as interrupted and asks the lead (who repairs it again: one more
# attempt), shows an open question again (answered then), resumes a step whose answer was recorded, and moves
# on a plan whose step's ending was written before the process died (the lead asked, the next step handed out)
PLAN_CRASH: Final[dict[str, str]] = {
    # step 1 on disk running, its dispatch never posted: interrupted, the lead repairs it
    "plan.dispatch": f"{_RESTART} · {_DONE}",
    # step 1's failure written, the lead never asked: asked at the restart
    "plan.complete": f"{_RESTART} · {_DONE}",
    # the repair written and step 1 handed out again, then the crash: interrupted, repaired once more
    "plan.repair": f"{_RESTART} · plan finished · check done (3 attempts), deploy done · question answered",
    # the question written, not posted (the builder's turn died with it): shown at the restart, answered
    "plan.question.asked": f"{_RESTART} · {_DONE}",
    # the answer written, the step not resumed: resumed at the restart with it
    "plan.question.answered": f"{_RESTART} · {_DONE}",
}

# error: the plan store's own error after a commit, in the live process. The plan is left idle there (nothing
# running, nobody asked) until the process is restarted, which moves it on as after a crash: the rig calls the
# process stuck, kills it and starts it again. (Worth a fix of its own: moving the plan on in the live process.)
_HUNG = "hung, killed, restarted"
PLAN_ERROR: Final[dict[str, str]] = {
    "plan.dispatch": f"{_HUNG} · {_DONE}",
    "plan.complete": f"{_HUNG} · {_DONE}",
    "plan.repair": f"{_HUNG} · plan finished · check done (3 attempts), deploy done · question answered",
    "plan.question.asked": f"{_HUNG} · {_DONE}",
    "plan.question.answered": f"{_HUNG} · {_DONE}",
}

_CRASH: Final = {**SWARM_CRASH, **MCP_CRASH, **PLAN_CRASH}
_ERROR: Final = {**SWARM_ERROR, **MCP_ERROR, **PLAN_ERROR}

# Among replicas (PostgreSQL: the restarted process is a replica under its own name) a plan is owned by the
# replica driving it; at its restart the replica takes over what its previous life owned (plans.owner) and
# repairs it as the one process does: the same endings as on SQLite.
KNOWN_BROKEN: Final[dict[tuple[str, str, str], str]] = {}

# hang: the point never returns; the rig calls the process stuck when the task (or plan) shows no progress within
# its bound, kills it and starts it again. Each ends as its crash does, the process "hung, killed" instead of
# "died": what the point had not written is not there, the restart says so (each cell looked at, on both stores).
_HANG: Final[dict[str, str]] = {
    point: ending.replace(_RESTART, _HUNG, 1) for point, ending in {**SWARM_CRASH, **PLAN_CRASH}.items()
} | {
    # the MCP call stuck before it reached the server: its call_timeout_seconds (10 s) ends it, the person is told
    # it did not reach the server, the process runs on
    "mcp.call": "ran on · approved · tool did not run",
}

# delay:300: every point a little late; nothing changes, on either store.
_DELAY: Final[dict[str, str]] = (
    dict.fromkeys(SWARM_CRASH, "ran on · task succeeded · checkpoint approved · 2 stage answer(s) kept")
    | dict.fromkeys(PLAN_CRASH, f"ran on · {_DONE}")
    | {"mcp.call": "ran on · approved · tool ran once"}
)

PINNED: Final[dict[tuple[str, str, str], str]] = {
    (point, action, store): ending
    for store in ("sqlite", "postgresql")
    for action, column in (("crash", _CRASH), ("error", _ERROR), ("hang", _HANG), ("delay:300", _DELAY))
    for point, ending in column.items()
    if (point, action, store) not in KNOWN_BROKEN
} | {
    # On PostgreSQL the checkpoint's transaction refused once is written on the writer's next try (the point
    # fires once): card and paused row both there, the person approves, the task succeeds
    ("swarm.checkpoint.card", "error", "postgresql"): (
        "ran on · task succeeded · checkpoint approved · 2 stage answer(s) kept"
    ),
}
