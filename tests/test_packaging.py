"""Packages are discovered, not listed: pyproject.toml maps each layer folder to ``kazma.<folder>`` and
setuptools finds every package below it. A wheel built from what the Dockerfile copies ships every module
of the tree and nothing else, and this checkout's editable install finds every package in its folder here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy_support import build_context

REPO = Path(__file__).resolve().parent.parent


def package_dirs() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    mapping: dict[str, str] = project["tool"]["setuptools"]["package-dir"]
    return mapping


def tree_modules() -> Iterator[tuple[str, Path]]:
    """Every module file of the layer folders, as the path it has inside an installed ``kazma``."""
    for package, folder in package_dirs().items():
        root = REPO / folder
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" not in path.parts:
                inside = "/".join([*package.split("."), *path.relative_to(root).parts])
                yield inside, path


def tree_packages() -> Iterator[tuple[str, Path]]:
    """Every folder holding an ``__init__.py``, with its dotted name."""
    for inside, path in tree_modules():
        if path.name == "__init__.py":
            yield inside.removesuffix("/__init__.py").replace("/", "."), path


def test_the_tree_has_the_rooms_as_packages() -> None:
    names = {name for name, _ in tree_packages()}
    assert {"kazma.config.store", "kazma.bot.cli", "kazma.engine.tools", "kazma.engine.swarm"} <= names


@pytest.mark.slow
def test_the_wheel_ships_every_module_of_the_tree(tmp_path: Path) -> None:
    context = build_context(tmp_path / "context")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(tmp_path / "wheels"), "."],
        cwd=context,
        check=True,
        timeout=600,
    )
    (wheel,) = (tmp_path / "wheels").glob("kazma-*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}
    expected = {inside for inside, _ in tree_modules()}
    assert sorted(expected - shipped) == [], "modules of the tree missing from the wheel"
    assert sorted(shipped - expected) == [], "modules in the wheel that the tree does not have"


def test_the_editable_install_finds_every_package_here() -> None:
    for name, init in tree_packages():
        spec = importlib.util.find_spec(name)
        assert spec is not None, name
        assert spec.origin is not None, name
        assert Path(spec.origin).resolve() == init.resolve(), name
