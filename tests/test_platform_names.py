"""Where the source names a chat platform: only its own package (``adapters/<platform>/``: its adapter, its
doctor check and setup commands), its registry entry (``config/registry/``: settings keys, ids, secrets, what
``kazma init`` asks, its failpoints) and at most eight files below, each with its reason. A new platform then
touches, outside its package and its registry entry, only its settings' section in ``config/models.py`` (and,
if ``kazma init`` offers it, its block of ``kazma.yaml`` in ``bot/templates/<platform>.yaml.in``, a data file).

A platform is "named" by a string literal or an identifier (a name, an attribute, a function, class or
argument, an imported module) holding 'telegram', 'slack' or 'discord' in any case; comments and docstrings
are prose and do not count.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("config", "approvals", "adapters", "engine", "bot")
NAMES = re.compile(r"telegram|slack|discord", re.IGNORECASE)
OWN = re.compile(r"^(adapters/(telegram|slack|discord)/|config/registry/)")

# Each file here names a platform for a reason a new platform does not share (it need not touch the file), with
# the reason. At most eight: what a platform needs of the shared code is in its registry entry and its package.
ALLOWED: dict[str, str] = {
    "config/models.py": "each platform's settings section: the one file outside its package a new platform adds to",
    # Sign in with Slack and Discord and Telegram's Mini App (issue 27): features of those platforms' own, which
    # a new platform has only if it brings a sign-in door of its own.
    "bot/console/auth.py": "the kinds of proof: Telegram's Mini App, Sign in with Slack and Discord",
    "bot/console/doors.py": "the sign-in doors of Slack and Discord and Telegram's Mini App",
    "bot/console/miniapp.py": "Telegram's Mini App and its landing page",
    "bot/console/platform_signin.py": "Sign in with Slack (OpenID Connect) and Discord (OAuth2)",
    "bot/console/server.py": "the routes of the platforms' sign-in doors",
    "bot/console/pages.py": "the platforms' badge colours, and the card's Mini App button as a way to decide",
    "bot/console/static.py": "the Mini App's script",
}
MOST: int = 8


def _docstrings(tree: ast.AST) -> set[int]:
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _named(node: ast.AST, docstrings: set[int]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return None if id(node) in docstrings else node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return node.name
    if isinstance(node, ast.ImportFrom):
        return node.module
    if isinstance(node, ast.alias):
        return node.name
    if isinstance(node, ast.arg):
        return node.arg
    return None


@functools.cache
def naming_files(root: Path) -> dict[str, list[int]]:
    """Every source file outside the platforms' own places that names a platform, with the lines."""
    found: dict[str, list[int]] = {}
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if OWN.match(relative):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            docstrings = _docstrings(tree)
            lines = sorted(
                {
                    getattr(node, "lineno", 0)
                    for node in ast.walk(tree)
                    if (text := _named(node, docstrings)) and NAMES.search(text)
                }
            )
            if lines:
                found[relative] = lines
    return found


def test_only_a_platforms_own_files_and_the_listed_ones_name_it() -> None:
    found = naming_files(ROOT)
    unexpected = {path: lines for path, lines in found.items() if path not in ALLOWED}
    assert not unexpected, f"these files name a chat platform outside its package and registry entry: {unexpected}"


def test_at_most_eight_shared_files_name_a_platform() -> None:
    assert len(ALLOWED) <= MOST, f"{len(ALLOWED)} files outside the platforms' own name one: {sorted(ALLOWED)}"
    assert len(naming_files(ROOT)) <= MOST


def test_the_list_holds_no_file_that_names_no_platform_any_more() -> None:
    stale = sorted(set(ALLOWED) - set(naming_files(ROOT)))
    assert not stale, f"remove from ALLOWED, they name no platform now: {stale}"


def test_the_walk_finds_a_platform_named_in_code_and_not_in_prose(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "named.py").write_text('"""Telegram is prose here."""\n# slack too\nX = {"discord": 1}\n')
    (tmp_path / "engine" / "prose.py").write_text('"""Telegram, Slack and Discord."""\n# telegram\nX = 1\n')
    (tmp_path / "adapters" / "slack").mkdir(parents=True)
    (tmp_path / "adapters" / "slack" / "own.py").write_text('NAME = "slack"\n')
    assert naming_files(tmp_path) == {"engine/named.py": [3]}
