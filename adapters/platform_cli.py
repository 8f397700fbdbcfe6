"""What the command line asks of a chat platform's own package: ``kazma doctor``'s check, ``kazma setup``'s
commands.

Each platform's package holds its own check (``kazma.adapters.<platform>.doctor``: whether the platform
accepts Kazma's tokens, whether the bot may post in the home chat) and its own setup commands; its registry
entry names them. The command line asks every platform that is on and writes the lines; this module is what
they share: one line of the doctor's answer, and what a setup command is handed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import httpx

from kazma.config import LoadedConfig
from kazma.config.registry import PlatformSpec


class Level(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Check:
    name: str
    level: Level
    detail: str  # one line; for a warning or a failure it names the fix


# A platform's check: its settings section and an HTTP client, every line it has to say.
PlatformCheck = Callable[[Any, httpx.AsyncClient], Awaitable[list[Check]]]


def json_body(response: httpx.Response) -> dict[str, Any]:
    """The response's JSON object; an empty one for anything else (a proxy's HTML page, a list)."""
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def token_problems(spec: PlatformSpec, section: Any) -> list[Check]:
    """Every secret of the platform that is set but shaped wrong, as its registry entry judges them."""
    name = f"platform.{spec.name}"
    return [
        Check(name, Level.FAIL, f"platforms.{spec.name}.{key} {problem}")
        for key, judge in spec.token_judges.items()
        if (value := str(getattr(section, key) or "")) and (problem := judge(value))
    ]


class ConfigSource(Protocol):
    """What a platform's ``kazma setup`` command is handed (the command line's context): the configuration,
    loaded when the command asks for it."""

    def load(self) -> LoadedConfig: ...
