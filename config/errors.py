"""Configuration errors: one line per problem, naming the file and key path."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def line(self, source: str) -> str:
        return f"{source}: {self.path}: {self.message}" if self.path else f"{source}: {self.message}"


class ConfigError(Exception):
    """``kazma.yaml`` cannot be used. ``str()`` gives one line per problem."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(p.line(source) for p in problems))

    @property
    def lines(self) -> list[str]:
        return [p.line(self.source) for p in self.problems]
