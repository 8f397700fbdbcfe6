"""The environment for a child Kazma: a ``kazma …`` or ``python -c`` process a test starts.

In a helper's worktree ``kazma`` is importable only through an import shim on PYTHONPATH, while the editable
install points at the main checkout. A child given ``PYTHONPATH=<repo>`` alone (the repo root holds ``engine/``,
not ``kazma/engine/``) therefore imported the main checkout's Kazma through the editable install, and the test
silently tested other code than the tree under test. The parent's PYTHONPATH comes first, then the repository:
the child imports Kazma from the same tree as the test itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

__all__ = ["REPO", "child_env"]


def child_env(extra: Mapping[str, str] | None = None, *, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (the parent's environment unless given), PYTHONPATH for this tree's Kazma, then ``extra``.

    PYTHONPATH always starts from the parent's own, even when ``base`` is a trimmed environment: the import shim
    is what decides which tree is under test."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)
    env.update(extra or {})
    return env
