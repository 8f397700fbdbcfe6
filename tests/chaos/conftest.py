"""The chaos matrix runs its CI slice (crash x SQLite, matrix.CI) with the suite; every other cell only when asked:
``KAZMA_CHAOS=all pytest -n 6 tests/chaos`` (or ``scripts/chaos``, which prints the matrix)."""

from __future__ import annotations

import os

import pytest

from tests.chaos.matrix import CI

# The slowest cells first, so that the workers finish together (xdist hands cells out in collection order): a
# hang waits out the rig's stuck bound before its restart, a crash restarts, PostgreSQL's replicas poll slower.
_COST = {"hang": 0, "crash": 1, "error": 2}


def _cost(item: pytest.Item) -> tuple[int, int]:
    _, action, store = _cell(item) or ("", "", "")
    return _COST.get(action, 3), 0 if store == "postgresql" else 1


def _cell(item: pytest.Item) -> tuple[str, str, str] | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None or "cell" not in callspec.params:
        return None
    point, action, store = callspec.params["cell"]
    return point, action, store


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("KAZMA_CHAOS") == "all":
        where = [i for i, item in enumerate(items) if _cell(item) is not None]
        for i, item in zip(where, sorted((items[i] for i in where), key=_cost), strict=True):
            items[i] = item
        return
    skip = pytest.mark.skip(reason="a chaos cell outside the CI column: run with KAZMA_CHAOS=all (scripts/chaos)")
    for item in items:
        cell = _cell(item)
        if cell is not None and cell not in CI:
            item.add_marker(skip)
