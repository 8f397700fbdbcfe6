"""The layers contract is real: it passes on the tree, fails when a lower layer imports a higher one, and
every link in it is used (a layer that never imports the one below it would make the contract say nothing)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
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


def _lint_imports() -> str:
    # Next to the running interpreter: a venv's scripts need not be on PATH.
    beside = Path(sys.executable).parent / "lint-imports"
    if beside.exists():
        return str(beside)
    found = shutil.which("lint-imports")
    if found is None:
        pytest.fail("lint-imports is not installed (pip install -e '.[dev]')")
    return found


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [_lint_imports()], cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_contract_holds_on_the_tree(tmp_path: Path) -> None:
    result = _lint(_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("lower", "higher"),
    [("config", "bot"), ("approvals", "adapters"), ("adapters", "engine"), ("engine", "bot")],
)
def test_contract_breaks_when_a_lower_layer_imports_a_higher_one(tmp_path: Path, lower: str, higher: str) -> None:
    root = _tree(tmp_path)
    (root / "kazma" / lower / "sneaky.py").write_text(f"import kazma.{higher}\n")
    result = _lint(root)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout
    assert f"kazma.{lower}.sneaky -> kazma.{higher}" in result.stdout


def test_contract_breaks_when_the_engine_imports_the_swarm(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    agent = root / "kazma" / "engine" / "agent.py"
    agent.write_text(agent.read_text() + "\nimport kazma.engine.swarm.service  # noqa\n")
    result = _lint(root)
    assert result.returncode != 0
    assert "kazma.engine.agent -> kazma.engine.swarm.service" in result.stdout


# Each case: modules written into a copy of the tree (path below kazma/ -> source) and the import the contract
# must name as broken. "Through another module" cases pin that the contracts are transitive.
_FORBIDDEN = {
    **{
        f"storage imports config.{model}": ({"config/store/sneaky.py": f"import kazma.config.{model}\n"},
                                            f"kazma.config.store.sneaky -> kazma.config.{model}")
        for model in ("models", "loader", "platforms")
    },
    "storage reaches the models through another module": (
        {
            "config/between.py": "import kazma.config.models\n",
            "config/store/sneaky.py": "import kazma.config.between\n",
        },
        "kazma.config.store.sneaky -> kazma.config.between",
    ),
    "console imports the command line": (
        {"bot/console/sneaky.py": "import kazma.bot.cli.doctor\n"}, "kazma.bot.console.sneaky -> kazma.bot.cli.doctor"
    ),
    **{
        f"console imports bot.{root}": ({"bot/console/sneaky.py": f"import kazma.bot.{root}\n"},
                                        f"kazma.bot.console.sneaky -> kazma.bot.{root}")
        for root in ("app", "lifecycle", "services")
    },
    "console reaches the app through another module": (
        {"bot/between.py": "import kazma.bot.app\n", "bot/console/sneaky.py": "import kazma.bot.between\n"},
        "kazma.bot.console.sneaky -> kazma.bot.between",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_FORBIDDEN))
def test_the_contract_breaks_on_a_forbidden_import(tmp_path: Path, case: str) -> None:
    modules, broken = _FORBIDDEN[case]
    root = _tree(tmp_path)
    for name, source in modules.items():
        (root / "kazma" / name).write_text(source)
    result = _lint(root)
    assert result.returncode != 0
    assert broken in result.stdout


def test_a_new_engine_module_must_be_placed_in_the_swarm_contract(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "kazma" / "engine" / "unplaced.py").write_text("X = 1\n")
    result = _lint(root)
    assert result.returncode != 0
    assert "unplaced" in result.stdout + result.stderr


_EDGES = """
import json, grimp
graph = grimp.build_graph("kazma", cache_dir=None)
print(json.dumps({m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}))
"""


def _graph(tmp_path: Path) -> dict[str, list[str]]:
    """Every module of the tree and what it imports directly, read by grimp (import-linter's own engine)."""
    return _graph_of(_tree(tmp_path))


def _graph_of(root: Path) -> dict[str, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", _EDGES], cwd=root, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    edges: dict[str, list[str]] = json.loads(result.stdout)
    assert len(edges) > 50, "grimp found too few modules: the tree was not read"
    return edges


@pytest.mark.parametrize(
    ("higher", "lower"),
    [
        ("kazma.bot", "kazma.engine"),
        ("kazma.engine", "kazma.adapters"),
        ("kazma.adapters", "kazma.approvals"),
        ("kazma.approvals", "kazma.config"),
    ],
)
def test_every_link_of_the_layers_is_real(tmp_path: Path, higher: str, lower: str) -> None:
    graph = _graph(tmp_path)
    importers = {
        module
        for module, imports in graph.items()
        if module.startswith(higher + ".") and not module.startswith("kazma.engine.swarm")
        for imported in imports
        if imported == lower or imported.startswith(lower + ".")
    }
    assert importers, f"nothing in {higher} (outside the swarm) imports {lower}: the link is empty"


def test_the_swarm_link_is_real(tmp_path: Path) -> None:
    graph = _graph(tmp_path)
    below = {
        imported
        for module, imports in graph.items()
        if module.startswith("kazma.engine.swarm")
        for imported in imports
        if imported.startswith("kazma.engine.") and not imported.startswith("kazma.engine.swarm")
    }
    assert below, "the swarm imports nothing from the rest of the engine"


# Circles between files that exist today (grimp counts imports inside functions and under TYPE_CHECKING
# too). This list only shrinks: a new circle fails below, and so does one listed here that is gone.
KNOWN_CIRCLES = {
    # The roster is built from the whole KazmaConfig (a type-only import back into the models that import
    # the roster). It goes when the roster is built from values at the seams (issue 26, the identity work).
    frozenset({"kazma.config.identity", "kazma.config.models"}),
}


def circles(edges: Mapping[str, Iterable[str]]) -> set[frozenset[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)

    for start in sorted(edges):
        if start in index:
            continue
        visit(start)
        work = [(start, iter(sorted(edges.get(start, ()))))]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    visit(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def test_the_circle_finder_finds_circles_and_nothing_else() -> None:
    edges = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": ["e"], "e": [], "f": ["a", "g"], "g": ["f"]}
    assert circles(edges) == {frozenset({"a", "b", "c"}), frozenset({"f", "g"})}
    assert circles({"a": ["b"], "b": ["c"], "c": []}) == set()


def test_the_import_graph_has_no_circle_between_files(tmp_path: Path) -> None:
    found = circles(_graph(tmp_path))
    new = sorted(sorted(circle) for circle in found - KNOWN_CIRCLES)
    assert new == [], "modules that import each other (directly, or round a longer circle): break the circle"
    gone = sorted(sorted(circle) for circle in KNOWN_CIRCLES - found)
    assert gone == [], "these circles are gone: remove them from KNOWN_CIRCLES"


def test_a_circle_through_an_import_inside_a_function_is_found(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "kazma" / "engine" / "circle_a.py").write_text("import kazma.engine.circle_b\n")
    (root / "kazma" / "engine" / "circle_b.py").write_text("def later() -> None:\n    import kazma.engine.circle_a\n")
    assert frozenset({"kazma.engine.circle_a", "kazma.engine.circle_b"}) in circles(_graph_of(root))
