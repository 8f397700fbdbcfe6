"""Each failpoint x action x store against a real ``kazma run`` on the wire fakes, checked from the outside."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.chaos.checker import ending, facts, violations
from tests.chaos.matrix import KNOWN_BROKEN, PINNED, SOMETIMES_BROKEN, cells
from tests.chaos.rig import run_cell
from tests.pg_support import find_bindir

RESULTS = os.environ.get("KAZMA_CHAOS_RESULTS")  # scripts/chaos: a file each cell appends its row to


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
    history = await run_cell(tmp_path, point, action, store=store, dsn=dsn)
    found = facts(history)
    got, broken = ending(history, found), violations(history, found)
    if RESULTS:
        with Path(RESULTS).open("a") as out:
            out.write(json.dumps({"cell": cell, "ending": got, "broken": broken, "fired": history.fired}) + "\n")
    assert history.fired, "the failpoint never fired: the scenario did not reach it"
    assert broken == []
    assert cell in PINNED, f"not pinned: {got}"
    pinned = PINNED[cell]
    assert got in ((pinned,) if isinstance(pinned, str) else pinned)
