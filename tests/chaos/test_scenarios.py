"""The plan, swarm and MCP scenarios' cells (tests/chaos/scenario_matrix.py), each against a real ``kazma run`` on the
wire fakes with one failpoint armed, checked from the outside. Only with ``KAZMA_CHAOS=all`` (scripts/chaos)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.chaos.checker import (
    ending,
    facts,
    plan_ending,
    plan_violations,
    swarm_ending,
    swarm_violations,
    violations,
)
from tests.chaos.rig import run_cell
from tests.chaos.scenario_matrix import KNOWN_BROKEN, MCP_POINTS, PINNED, PLAN_POINTS, SOMETIMES_BROKEN, cells
from tests.chaos.scenario_mcp import McpScenario
from tests.chaos.scenario_plan import run_plan_cell
from tests.chaos.scenario_swarm import run_swarm_cell
from tests.pg_support import find_bindir

RESULTS = os.environ.get("KAZMA_CHAOS_RESULTS")


@pytest.mark.slow
@pytest.mark.parametrize("cell", cells(), ids=lambda c: "-".join(c))
async def test_cell(cell: tuple[str, str, str], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    point, action, store = cell
    dsn = None
    if store == "postgresql":
        if find_bindir() is None:
            pytest.skip("no PostgreSQL server binaries")
        dsn = str(request.getfixturevalue("pg_dsn"))
    if cell in KNOWN_BROKEN:
        request.applymarker(pytest.mark.xfail(reason=KNOWN_BROKEN[cell], strict=True))
    if cell in SOMETIMES_BROKEN:
        request.applymarker(pytest.mark.xfail(reason=SOMETIMES_BROKEN[cell], strict=False))
    if point in PLAN_POINTS:
        plan = await run_plan_cell(tmp_path, point, action, store=store, dsn=dsn)
        history = plan
        got, broken = plan_ending(plan), plan_violations(plan)
    elif point in MCP_POINTS:
        history = await run_cell(tmp_path, point, action, store=store, dsn=dsn, scenario=McpScenario)
        found = facts(history)
        got, broken = ending(history, found), violations(history, found)
    else:
        swarm = await run_swarm_cell(tmp_path, point, action, store=store, dsn=dsn)
        history = swarm
        got, broken = swarm_ending(swarm), swarm_violations(swarm)
    if RESULTS:
        with Path(RESULTS).open("a") as out:
            out.write(json.dumps({"cell": cell, "ending": got, "broken": broken, "fired": history.fired}) + "\n")
    assert history.fired, "the failpoint never fired: the scenario did not reach it"
    assert broken == []
    assert cell in PINNED, f"not pinned: {got}"
    pinned = PINNED[cell]
    assert got in ((pinned,) if isinstance(pinned, str) else pinned)
