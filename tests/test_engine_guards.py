"""Guards over the whole engine package, not one path at a time (the swarm design's §1.0d and §9).

1. Every ``except`` (and ``contextlib.suppress``) that neither re-raises nor logs at WARNING or above is
   declared in :data:`kazma.engine.guards.QUIET_HANDLERS` with its reason; a new quiet one fails here.
2. Model-bound text built from worker or tool output goes through the fence: only the fence makes a
   :class:`~kazma.engine.fence.Fenced`, model messages are built only in :mod:`kazma.engine.messages`, and
   text built from worker or tool output outside the fence is declared in
   :data:`kazma.engine.guards.UNFENCED_TEXT` with why it never reaches a model. mypy holds the typed
   boundaries (``Worker.run``'s context, ``user_with_data``): a plain string there is a type error.

Each scanner is also run on a small module written to break its rule, so a scanner that finds nothing
cannot pass for one that checks.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kazma.engine.guards import QUIET_HANDLERS, UNFENCED_TEXT

REPO = Path(__file__).resolve().parent.parent
ENGINE = REPO / "engine"
LOUD = {"warning", "error", "exception", "critical"}
# Fields that hold what a worker, a tool or a model wrote.
UNTRUSTED_FIELDS = {
    "output",
    "error",
    "output_summary",
    "failure_reason",
    "summary",
    "handoff_context",
    "handoff_reason",
    "handoff_task",
    "result",
}


def engine_modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(ENGINE.rglob("*.py")):
        name = path.relative_to(ENGINE).as_posix()
        if name != "guards.py":
            yield name, ast.parse(path.read_text(), filename=str(path))


class _Scope(ast.NodeVisitor):
    """Walks a module knowing the qualified name of the function (or class) each node is in."""

    def __init__(self) -> None:
        self.stack: list[str] = []

    @property
    def where(self) -> str:
        return ".".join(self.stack)

    def _enter(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter


def _is_loud(body: list[ast.stmt]) -> bool:
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Raise):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOUD:
            return True
    return False


def quiet_handlers(module: str, tree: ast.Module) -> list[str]:
    found: list[str] = []

    class Visitor(_Scope):
        def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
            if not _is_loud(node.body):
                caught = "bare" if node.type is None else ast.unparse(node.type)
                found.append(f"{module}:{self.where}:{caught}")
            self.generic_visit(node)

        def visit_Call(self, node: ast.Call) -> None:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name == "suppress":
                found.append(f"{module}:{self.where}:suppress({', '.join(ast.unparse(a) for a in node.args)})")
            self.generic_visit(node)

    Visitor().visit(tree)
    return found


def _builds_text(node: ast.AST) -> bool:
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mod):
        return True
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("join", "format")


def _unfenced_reads(node: ast.AST) -> list[str]:
    """Untrusted fields read in ``node`` other than inside a ``fence_untrusted(...)`` call."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "fence_untrusted":
        return []
    found = [node.attr] if isinstance(node, ast.Attribute) and node.attr in UNTRUSTED_FIELDS else []
    for child in ast.iter_child_nodes(node):
        found += _unfenced_reads(child)
    return found


def unfenced_text(module: str, tree: ast.Module) -> set[str]:
    """Functions that build text out of worker or tool output outside the fence."""
    found: set[str] = set()

    class Visitor(_Scope):
        def generic_visit(self, node: ast.AST) -> None:
            if _builds_text(node) and _unfenced_reads(node):
                found.add(f"{module}:{self.where}")
                return  # the outermost builder names the function; what is inside it is the same text
            super().generic_visit(node)

    Visitor().visit(tree)
    return found


def model_messages(module: str, tree: ast.Module) -> list[str]:
    """Dict literals shaped as model messages (a ``"role"`` key)."""
    return [
        f"{module}:{node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "role" for k in node.keys)
    ]


def fenced_makers(module: str, tree: ast.Module) -> list[str]:
    """Calls that make a ``Fenced`` value other than through the fence (``Fenced(x)``, ``cast(Fenced, x)``)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        casts = name == "cast" and node.args and "Fenced" in ast.unparse(node.args[0])
        if name == "Fenced" or casts:
            found.append(f"{module}:{node.lineno}")
    return found


# -- 1. quiet handlers ------------------------------------------------------------------------------


def test_every_quiet_handler_in_the_engine_is_declared_with_its_reason() -> None:
    found = {key for name, tree in engine_modules() for key in quiet_handlers(name, tree)}
    undeclared = sorted(found - set(QUIET_HANDLERS))
    assert undeclared == [], (
        "these handlers swallow an exception without a WARNING: log it, re-raise it, or declare it in "
        "kazma.engine.guards.QUIET_HANDLERS with why staying quiet loses nothing"
    )
    assert sorted(set(QUIET_HANDLERS) - found) == [], "declared handlers that no longer exist: remove them"
    assert all(len(reason) > 20 for reason in QUIET_HANDLERS.values())


def test_the_handler_scanner_finds_a_quiet_handler_and_passes_a_loud_one() -> None:
    source = """
import contextlib
async def swallow(call):
    try:
        await call()
    except Exception:
        pass
    with contextlib.suppress(OSError):
        await call()
async def loud(call):
    try:
        await call()
    except Exception as exc:
        log.warning("x.failed", error=str(exc))
    try:
        await call()
    except ValueError:
        log.info("x.noted")
        raise
"""
    assert quiet_handlers("m.py", ast.parse(source)) == ["m.py:swallow:Exception", "m.py:swallow:suppress(OSError)"]


# -- 2. the fence -------------------------------------------------------------------------------------


def test_only_the_fence_makes_fenced_text() -> None:
    makers = [m for name, tree in engine_modules() if name != "fence.py" for m in fenced_makers(name, tree)]
    assert makers == [], "Fenced text is made only by kazma.engine.fence (fence_untrusted, join_fenced)"
    assert fenced_makers("m.py", ast.parse("x = Fenced(s)\ny = cast(Fenced, s)\n")) == ["m.py:1", "m.py:2"]


def test_model_messages_are_built_only_by_the_message_constructors() -> None:
    built = [m for name, tree in engine_modules() if name != "messages.py" for m in model_messages(name, tree)]
    assert built == [], "build model messages with kazma.engine.messages (its data parameters take Fenced)"
    assert model_messages("m.py", ast.parse('m = {"role": "user", "content": f"{r.output}"}\n')) == ["m.py:1"]


def test_text_built_from_worker_or_tool_output_outside_the_fence_is_declared() -> None:
    found = {key for name, tree in engine_modules() for key in unfenced_text(name, tree)}
    undeclared = sorted(found - set(UNFENCED_TEXT))
    assert undeclared == [], (
        "these functions build text from worker or tool output outside fence_untrusted: fence it, or declare in "
        "kazma.engine.guards.UNFENCED_TEXT why that text never reaches a model"
    )
    assert sorted(set(UNFENCED_TEXT) - found) == [], "declared functions that no longer build such text"


def test_the_text_scanner_tells_fenced_from_unfenced() -> None:
    source = """
def to_model(result):
    return f"answer: {fence_untrusted(result.output, source='w')}"
def leaks(result):
    return "answer: " + result.output
"""
    assert unfenced_text("m.py", ast.parse(source)) == {"m.py:leaks"}


def test_mypy_refuses_an_unfenced_string_where_fenced_text_is_due(tmp_path: Path) -> None:
    snippet = tmp_path / "leak.py"
    snippet.write_text(
        "from kazma.engine import messages\n"
        "from kazma.engine.swarm.types import Worker, WorkerResult\n\n\n"
        "async def leak(worker: Worker, earlier: WorkerResult) -> None:\n"
        "    await worker.run('next', context=earlier.output)\n"
        "    messages.user_with_data('what now?', earlier.output)\n"
    )
    typecheck = REPO / ".typecheck"
    typecheck.joinpath("kazma").mkdir(parents=True, exist_ok=True)
    for layer in ("config", "approvals", "adapters", "engine", "bot"):
        link = typecheck / "kazma" / layer
        if not link.exists():
            link.symlink_to(Path("../..") / layer)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-incremental", str(snippet)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "MYPYPATH": str(typecheck)},
        timeout=300,
        check=False,
    )
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, done.stdout + done.stderr
    assert all('expected "Fenced"' in line for line in errors), errors


@pytest.mark.parametrize("module", ["engine/swarm/patterns.py", "engine/swarm/workers.py"])
def test_worker_context_is_typed_fenced(module: str) -> None:
    tree = ast.parse((REPO / module).read_text())
    annotations = [
        ast.unparse(arg.annotation)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for arg in [*node.args.args, *node.args.kwonlyargs]
        if arg.arg in ("context", "original") and arg.annotation is not None
    ]
    assert annotations, module
    assert all(a == "Fenced" for a in annotations), annotations
