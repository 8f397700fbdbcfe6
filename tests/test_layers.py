"""The layers contract is real: it passes on the tree and fails when a lower layer imports a higher one."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAYERS = ("config", "approvals", "adapters", "engine", "bot")


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    (root / "kazma").mkdir(parents=True)
    for layer in LAYERS:
        shutil.copytree(REPO / layer, root / "kazma" / layer, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed (pip install -e '.[dev]')")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([exe], cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_contract_holds_on_the_tree(tmp_path: Path) -> None:
    result = _lint(_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(("lower", "higher"), [("config", "bot"), ("approvals", "adapters"), ("adapters", "engine")])
def test_contract_breaks_when_a_lower_layer_imports_a_higher_one(tmp_path: Path, lower: str, higher: str) -> None:
    root = _tree(tmp_path)
    (root / "kazma" / lower / "sneaky.py").write_text(f"import kazma.{higher}\n")
    result = _lint(root)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout
    assert f"kazma.{lower}.sneaky -> kazma.{higher}" in result.stdout
