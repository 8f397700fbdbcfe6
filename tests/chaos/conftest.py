"""The chaos matrix runs its CI slice (crash x SQLite, matrix.CI) with the suite; every other cell only when asked:
``KAZMA_CHAOS=all pytest -n 2 tests/chaos`` (or ``scripts/chaos``, which prints the matrix)."""

from __future__ import annotations

import os

import pytest

from tests.chaos.matrix import CI


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("KAZMA_CHAOS") == "all":
        return
    skip = pytest.mark.skip(reason="a chaos cell outside the CI column: run with KAZMA_CHAOS=all (scripts/chaos)")
    for item in items:
        cell = getattr(item, "callspec", None)
        if cell is not None and "cell" in cell.params and tuple(cell.params["cell"]) not in CI:
            item.add_marker(skip)
