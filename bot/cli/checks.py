"""One line of ``kazma doctor``: what was checked, how it went, and what to do about it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Level(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Check:
    name: str
    level: Level
    detail: str  # one line; for a warning or a failure it names the fix
