"""Each failpoint x action x store against a real ``kazma run`` on the wire fakes, checked from the outside."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.chaos.matrix import KNOWN_BROKEN, LEFT_OUT, PINNED, SOMETIMES_BROKEN, cells
from tests.chaos.scenarios import SCENARIOS, scenario_of
from tests.pg_support import find_bindir

RESULTS = os.environ.get("KAZMA_CHAOS_RESULTS")  # scripts/chaos: a file each cell appends its row to


@pytest.mark.slow
@pytest.mark.parametrize("cell", cells(), ids=lambda c: "-".join(c))
async def test_cell(cell: tuple[str, str, str], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    point, _, store = cell
    dsn = None
    if store == "postgresql":
        if find_bindir() is None:
            pytest.skip("no PostgreSQL server binaries")
        dsn = str(request.getfixturevalue("pg_dsn"))
    if cell in KNOWN_BROKEN:
        request.applymarker(pytest.mark.xfail(reason=KNOWN_BROKEN[cell], strict=True))
    if cell in SOMETIMES_BROKEN:
        request.applymarker(pytest.mark.xfail(reason=SOMETIMES_BROKEN[cell], strict=False))
    began = time.monotonic()
    judged = await scenario_of(point).run(tmp_path, cell, dsn)
    seconds = round(time.monotonic() - began, 1)
    got, broken = judged.ending, judged.broken
    if RESULTS:
        row = {"cell": cell, "ending": got, "broken": broken, "fired": judged.fired, "seconds": seconds}
        with Path(RESULTS).open("a") as out:
            out.write(json.dumps(row) + "\n")
    assert judged.fired, "the failpoint never fired: the scenario did not reach it"
    assert broken == []
    assert cell in PINNED, f"not pinned: {got}"
    pinned = PINNED[cell]
    assert got in ((pinned,) if isinstance(pinned, str) else pinned)


def test_every_point_belongs_to_one_scenario_and_every_cell_left_out_says_why() -> None:
    """A point two scenarios claim would be pinned twice (or by whichever ran); a cell left out must say why."""
    points = [point for scenario in SCENARIOS for point in scenario.points]
    assert len(points) == len(set(points))
    assert len({scenario.name for scenario in SCENARIOS}) == len(SCENARIOS)
    for point in points:
        assert scenario_of(point).name
    assert all(why.strip() for why in LEFT_OUT.values())
    assert not set(LEFT_OUT) & set(cells())
