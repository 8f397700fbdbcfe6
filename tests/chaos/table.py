"""The chaos matrix as a table: ``python -m tests.chaos.table RESULTS [WALL_SECONDS WORKERS]`` prints point x
action x store -> ending from the rows the cells wrote (``KAZMA_CHAOS_RESULTS``), each with its seconds and
whether its ending is the one pinned (:mod:`tests.chaos.matrix`), then the cells left out and the run's time."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.chaos.matrix import KNOWN_BROKEN, LEFT_OUT, PINNED, SOMETIMES_BROKEN


def verdict(cell: tuple[str, str, str], ending: str, broken: list[str], fired: bool) -> str:
    """pinned (the ending pinned for the cell), or why not: what a reader of the table must look at."""
    if cell in KNOWN_BROKEN:
        return "known broken"
    if not fired:
        return "NEVER FIRED"
    if broken:
        return "SOMETIMES BROKEN" if cell in SOMETIMES_BROKEN else "BROKEN"
    pinned = PINNED.get(cell)
    if pinned is None:
        return "NOT PINNED"
    return "pinned" if ending in ((pinned,) if isinstance(pinned, str) else pinned) else "OTHER ENDING"


def table(rows: list[dict[str, Any]], wall: str | None = None, workers: str | None = None) -> str:
    rows = sorted(rows, key=lambda r: (r["cell"][2], r["cell"][1], r["cell"][0]))
    width = max([len(r["cell"][0]) for r in rows] + [len(cell[0]) for cell in LEFT_OUT], default=10)
    lines = [f"{'point':<{width}}  {'action':<9}  {'store':<10}  {'s':>4}  {'':<12}  ending"]
    for r in rows:
        cell = (r["cell"][0], r["cell"][1], r["cell"][2])
        said = verdict(cell, r["ending"], r["broken"], r["fired"])
        broken = f"   BROKEN: {'; '.join(r['broken'])}" if r["broken"] else ""
        lines.append(
            f"{cell[0]:<{width}}  {cell[1]:<9}  {cell[2]:<10}  {r.get('seconds', 0):>4.0f}  {said:<12}  "
            f"{r['ending']}{broken}"
        )
    for (point, action, store), why in sorted(LEFT_OUT.items(), key=lambda c: (c[0][2], c[0][1], c[0][0])):
        lines.append(f"{point:<{width}}  {action:<9}  {store:<10}  {'':>4}  {'left out':<12}  {why}")
    total = sum(float(r.get("seconds", 0)) for r in rows)
    counts: dict[str, int] = {}
    for r in rows:
        said = verdict((r["cell"][0], r["cell"][1], r["cell"][2]), r["ending"], r["broken"], r["fired"])
        counts[said] = counts.get(said, 0) + 1
    summary = ", ".join(f"{n} {said}" for said, n in sorted(counts.items()))
    run = f", {wall} s of wall time with {workers} at once" if wall else ""
    lines.append(f"\n{len(rows)} cells run ({summary}), {len(LEFT_OUT)} left out; {total:.0f} s of cells{run}")
    return "\n".join(lines)


if __name__ == "__main__":
    found = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
    print(table(found, *sys.argv[2:4]))
