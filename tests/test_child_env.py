"""A child Kazma imports the tree under test, not whatever the editable install points at."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import kazma.engine
from tests.child_env import REPO, child_env

_WHERE = "import kazma.engine; print(kazma.engine.__file__)"


def test_a_child_imports_kazma_from_the_parents_tree() -> None:
    """In a worktree the parent's ``kazma`` is the shim's (the worktree), and the editable install's is the main
    checkout: the child must land on the parent's. In CI both are the checkout, and this still holds."""
    result = subprocess.run(
        [sys.executable, "-c", _WHERE], env=child_env(), capture_output=True, text=True, timeout=60, check=True
    )
    child = Path(result.stdout.strip()).resolve()
    assert child == Path(kazma.engine.__file__).resolve()


def test_no_child_environment_names_pythonpath_itself() -> None:
    """Every child's PYTHONPATH comes from :func:`child_env`: one written by hand (``PYTHONPATH=<repo>``) dropped
    the worktree's shim. test_layers.py points grimp and lint-imports at a copied tree on purpose."""
    own = {Path(__file__).resolve(), REPO / "tests" / "child_env.py", REPO / "tests" / "test_layers.py"}
    by_hand = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        if path.resolve() not in own
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"""["']PYTHONPATH["']""", line)
    ]
    assert by_hand == []
