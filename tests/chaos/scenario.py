"""What a chaos scenario is, for the matrix (:mod:`tests.chaos.matrix`) to run each of its cells.

A scenario is a story a person (or an agent, or an API client) lives through against real ``kazma run``
processes on the wire fakes, crossing some failpoints on the way. It provides:

- ``name``: short, stable, the word ``pytest -k`` selects it by;
- ``points``: the failpoints it crosses (each named in ``config/failpoints.py``; each point belongs to one
  scenario, whose cells pin it: point × action × store);
- ``drive``: runs one cell — starts the fakes and the process(es) with the point armed, does what the person
  or client does, restarts what died or hung, and returns what happened as seen from outside (its history:
  any type the scenario likes; nothing in it is Kazma's own account of itself);
- ``judge``: the checker, reading that history (and what it names: the store's tables through a connection
  of its own, the fakes, the workspace) into a :class:`Judged` — the ending in the words the matrix pins,
  every broken invariant, and whether the point fired at all;
- ``left_out``: the stores it does not run on, each with why (a point the store never reaches: no cell,
  printed by ``scripts/chaos`` with its reason).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

Cell = tuple[str, str, str]  # point, action ("crash", "error", "hang", "delay:<ms>"), store

H = TypeVar("H")


@dataclass(frozen=True)
class Judged:
    ending: str  # how the cell ended, in the words the matrix pins
    broken: list[str]  # every invariant broken; empty is the only passing answer
    fired: bool  # the failpoint said it fired (its line on stderr): the cell injected something


@dataclass(frozen=True)
class Scenario(Generic[H]):
    name: str
    points: tuple[str, ...]
    drive: Callable[[Path, Cell, str | None], Awaitable[H]]  # tmp folder, the cell, the PostgreSQL DSN (or None)
    judge: Callable[[H], Judged]
    left_out: Mapping[str, str] = field(default_factory=dict)  # store -> why no cell runs there

    async def run(self, tmp: Path, cell: Cell, dsn: str | None) -> Judged:
        return self.judge(await self.drive(tmp, cell, dsn))
