"""Which chaos cells a run holds. ``KAZMA_CHAOS=all``: every cell (``scripts/chaos``, which prints the matrix);
``ci``: the CI column (the crash column on SQLite and three PostgreSQL cells, matrix.CI), which ``scripts/check``
runs in a step of its own, six cells at a time (a cell mostly waits on its processes); ``none``: no cell (the
suite's own step). Unset: the CI column, as a plain ``pytest`` run always did."""

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
    mode = os.environ.get("KAZMA_CHAOS", "ci")
    where = [i for i, item in enumerate(items) if _cell(item) is not None]
    for i, item in zip(where, sorted((items[i] for i in where), key=_cost), strict=True):
        items[i] = item
    if mode == "all":
        return
    if mode == "none":
        skip = pytest.mark.skip(reason="the chaos cells run in a step of their own (scripts/check, KAZMA_CHAOS=ci)")
    else:
        skip = pytest.mark.skip(reason="a chaos cell outside the CI column: run with KAZMA_CHAOS=all (scripts/chaos)")
    for item in items:
        cell = _cell(item)
        if cell is not None and (mode == "none" or cell not in CI):
            item.add_marker(skip)
