"""``${VAR}`` and ``${VAR:-default}`` substitution on a parsed YAML tree.

Substitution walks the parsed tree rather than the raw text: a value from the
environment can never change the YAML structure, and each missing variable is
reported with the key path that asked for it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_REFERENCE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*?))?\}")


@dataclass
class Substitution:
    """What a substitution pass found: the new tree, the variables each path used, what was missing."""

    tree: Any
    references: dict[str, list[str]] = field(default_factory=dict)
    missing: list[tuple[str, str]] = field(default_factory=list)
    # (key path, variable) whose value ended in white space that was dropped (see _expand)
    trimmed: list[tuple[str, str]] = field(default_factory=list)


def format_path(parts: tuple[str | int, ...]) -> str:
    """``("pipelines", "quick", 1)`` → ``pipelines.quick[1]``."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def substitute(tree: Any, environ: Mapping[str, str]) -> Substitution:
    result = Substitution(tree=None)
    result.tree = _walk(tree, (), environ, result)
    return result


def _walk(node: Any, path: tuple[str | int, ...], environ: Mapping[str, str], result: Substitution) -> Any:
    if isinstance(node, dict):
        return {key: _walk(value, (*path, str(key)), environ, result) for key, value in node.items()}
    if isinstance(node, list):
        return [_walk(value, (*path, index), environ, result) for index, value in enumerate(node)]
    if isinstance(node, str) and "$" in node:
        return _expand(node, path, environ, result)
    return node


def _expand(text: str, path: tuple[str | int, ...], environ: Mapping[str, str], result: Substitution) -> str:
    where = format_path(path)

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, default = match.group(1), match.group(2)
        result.references.setdefault(where, []).append(name)
        value = environ.get(name)
        if value is not None and (value != "" or default is None):
            return value
        if default is not None:
            return default
        result.missing.append((where, name))
        return ""

    whole = _REFERENCE.fullmatch(text)
    if whole is not None and whole.group(1) is not None:
        # A value that is one variable is a token, a password, a URL: a trailing line break or space there is what
        # reading a secret from a file (a Kubernetes secret, "$(<file)" of a file with a blank line) brings with
        # it, never part of the secret; kept, the platform refused the token while `kazma doctor` said why.
        value = replace(whole)
        kept = value.rstrip()
        if kept != value:
            result.trimmed.append((where, whole.group(1)))
        return kept
    return _REFERENCE.sub(replace, text)
