"""Every chaos scenario (:class:`tests.chaos.scenario.Scenario`), and which one crosses a given failpoint.

A new scenario: a driver and a checker of its own (a module beside :mod:`tests.chaos.rig`, reusing its
``Rig``, ``run_restarting`` and ``observe`` where they fit), an entry in :data:`SCENARIOS`, and its cells'
endings pinned in :mod:`tests.chaos.matrix`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from tests.chaos import checker
from tests.chaos.doors import API, INBOX
from tests.chaos.replicas import CLAIM, TAKEOVER
from tests.chaos.rig import History, run_cell
from tests.chaos.scenario import Cell, Scenario
from tests.chaos.scenario_mcp import run_mcp_cell
from tests.chaos.scenario_plan import run_plan_cell
from tests.chaos.scenario_swarm import run_swarm_cell


async def _approval(tmp: Path, cell: Cell, dsn: str | None) -> History:
    point, action, store = cell
    return await run_cell(tmp, point, action, store=store, dsn=dsn)


# An approved shell call across Telegram and Discord (tests/chaos/rig.py), through every boundary of an approval.
APPROVAL: Final = Scenario(
    name="approval",
    points=(
        "approvals.open.row",
        "approvals.open.card_job",
        "approvals.open.committed",
        "bus.post",
        "bus.post.recorded",
        "approvals.decide.before_commit",
        "approvals.decide.after_commit",
        "approvals.decide.before_answer",
        "bus.settle.sent",
        "bus.settle.recorded",
        "tools.verified",
        "tools.started",
        "tools.finished",
        "tools.recorded",
    ),
    drive=_approval,
    judge=checker.judge,
)

# A plan of two dependent steps handed to sub-agents in the group: one fails and the lead repairs it, one asks
# the person a question answered by a reply (tests/chaos/scenario_plan.py).
PLAN: Final = Scenario(
    name="plan",
    points=("plan.dispatch", "plan.complete", "plan.repair", "plan.question.asked", "plan.question.answered"),
    drive=run_plan_cell,
    judge=checker.plan_judge,
)

# A /swarm pipeline: a checkpoint card a person approves, paused and resumed, a handoff, its result stored and
# delivered; `kazma swarm status` read at the end (tests/chaos/scenario_swarm.py).
SWARM: Final = Scenario(
    name="swarm",
    points=(
        "swarm.admitted",
        "swarm.step.started",
        "swarm.step.finished",
        "swarm.checkpoint.card",
        "swarm.checkpoint.paused",
        "swarm.resumed",
        "swarm.handoff",
        "swarm.result.stored",
    ),
    drive=run_swarm_cell,
    judge=checker.swarm_judge,
)

# The approved call is a real MCP server's tool over stdio (tests/chaos/scenario_mcp.py); judged as the
# approval scenario is, the server's own log of its calls standing for the marker.
MCP: Final = Scenario(name="mcp", points=("mcp.call",), drive=run_mcp_cell, judge=checker.judge)

SCENARIOS: Final[tuple[Scenario[Any], ...]] = (APPROVAL, API, INBOX, CLAIM, TAKEOVER, PLAN, SWARM, MCP)


def scenario_of(point: str) -> Scenario[Any]:
    """The scenario whose cells pin ``point`` (each point belongs to exactly one)."""
    found = [s for s in SCENARIOS if point in s.points]
    if len(found) != 1:
        raise LookupError(f"failpoint {point!r} is crossed by {len(found)} scenarios' cells, not one")
    return found[0]
