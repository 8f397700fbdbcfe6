"""The swarm and MCP scenarios' cells: point x action x store -> the ending pinned for it (the approval
scenario's are :mod:`tests.chaos.matrix`; the same rules: a cell with no entry fails as "not pinned",
``KNOWN_BROKEN`` cells are expected to fail until fixed, with why).

The plan cells run :mod:`tests.chaos.scenario_plan`, judged by :func:`tests.chaos.checker.plan_violations`;
the swarm cells run :mod:`tests.chaos.scenario_swarm` and are judged by :func:`tests.chaos.checker.swarm_violations`;
the MCP cell runs :mod:`tests.chaos.scenario_mcp` and is judged by the approval scenario's checker.
"""

from __future__ import annotations

from typing import Final

from tests.chaos.matrix import Ending

# The points the swarm scenario crosses, in the order it reaches them.
SWARM_POINTS: Final = (
    "swarm.admitted",
    "swarm.step.started",
    "swarm.step.finished",
    "swarm.checkpoint.card",
    "swarm.checkpoint.paused",
    "swarm.resumed",
    "swarm.handoff",
    "swarm.result.stored",
)
MCP_POINTS: Final = ("mcp.call",)
# The points the plan scenario crosses, in the order it reaches them.
PLAN_POINTS: Final = (
    "plan.dispatch",
    "plan.complete",
    "plan.repair",
    "plan.question.asked",
    "plan.question.answered",
)
STORES: Final = ("sqlite", "postgresql")


def cells() -> list[tuple[str, str, str]]:
    """crash and error on both stores; hang and delay:300 on SQLite (every point here is bounded there)."""
    points = (*PLAN_POINTS, *SWARM_POINTS, *MCP_POINTS)
    return [(p, a, s) for s in STORES for a in ("crash", "error") for p in points] + [
        (p, a, "sqlite") for a in ("hang", "delay:300") for p in points
    ]


PINNED: Final[dict[tuple[str, str, str], Ending]] = {}

KNOWN_BROKEN: Final[dict[tuple[str, str, str], str]] = {}
SOMETIMES_BROKEN: Final[dict[tuple[str, str, str], str]] = {}
