"""Every structlog event name in the source is a literal: grep finds each one, and dashboards can rely on it.

An event name built at run time (``f"{self.name}.started"``, a variable) cannot be searched for and changes with
its inputs; the varying part belongs in a field (``platform=…``). The walk reads the source packages, finds the
names bound to ``structlog.get_logger(…)`` in each module (a module's ``log``, an attribute set from it) and
holds every call of a logging method on them to a string literal first argument.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("config", "approvals", "adapters", "engine", "bot")
METHODS = frozenset({"debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "msg"})


def _loggers(tree: ast.AST) -> set[str]:
    """Names (and attribute names) that a ``structlog.get_logger(...)`` call is assigned to in this module."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
            continue
        call = node.value
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
            continue
        if call.func.attr != "get_logger" or ast.unparse(call.func.value) != "structlog":
            continue
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            if isinstance(target, ast.Name):
                names.add(target.id)
            elif isinstance(target, ast.Attribute):
                names.add(target.attr)
    return names


def _receiver(call: ast.Call) -> str | None:
    assert isinstance(call.func, ast.Attribute)
    owner = call.func.value
    if isinstance(owner, ast.Name):
        return owner.id
    if isinstance(owner, ast.Attribute):
        return owner.attr
    return None


def logging_calls(source: str) -> Iterator[tuple[int, ast.expr | None]]:
    """(line, first argument) of every logging call on a structlog logger of this module."""
    tree = ast.parse(source)
    loggers = _loggers(tree)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in METHODS
            and _receiver(node) in loggers
        ):
            yield node.lineno, node.args[0] if node.args else None


def _is_literal(first: ast.expr | None) -> bool:
    return isinstance(first, ast.Constant) and isinstance(first.value, str)


def _modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py"))


def test_every_event_name_is_a_literal() -> None:
    built: list[str] = []
    checked = 0
    for path in _modules():
        for line, first in logging_calls(path.read_text(encoding="utf-8")):
            checked += 1
            if not _is_literal(first):
                shown = "no event name" if first is None else ast.unparse(first)
                built.append(f"{path.relative_to(REPO)}:{line}: {shown}")
    assert checked > 300, f"only {checked} logging calls found: the walk no longer sees the loggers"
    assert not built, "event names must be string literals (put the varying part in a field):\n" + "\n".join(built)


@pytest.mark.parametrize(
    "call",
    [
        'log.info(f"{self.name}.started", platform=self.name)',
        'log.error(f"bus.{what}_failed", error=str(exc))',
        "log.warning(event, platform=name)",
        'log.exception("x." + site)',
        "log.info(event=name)",
        'self.log.debug(f"{kind}.seen")',
    ],
)
def test_a_built_event_name_is_caught(call: str) -> None:
    source = f'import structlog\nlog = structlog.get_logger("kazma.x")\nself.log = structlog.get_logger()\n{call}\n'
    found = list(logging_calls(source))
    assert len(found) == 1
    assert not _is_literal(found[0][1])


def test_a_literal_event_name_passes_and_other_loggers_are_not_read() -> None:
    source = (
        "import logging, structlog\n"
        'log = structlog.get_logger("kazma.x")\n'
        'log.info("platform.started", platform=name)\n'
        'logging.getLogger("x").info(f"{name} is stdlib, its messages are text")\n'
    )
    found = list(logging_calls(source))
    assert [_is_literal(first) for _, first in found] == [True]
