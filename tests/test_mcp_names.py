"""Tools of MCP servers are offered to models under names that never collide: real SDK servers
(tests/mcp_servers/spy.py, offering tools by the names the test gives) in one registry."""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from kazma.config.models import DangerLevel, MCPServerConfig
from kazma.engine.tools.mcp_tools import MCPSources, model_name
from kazma.engine.tools.registry import ToolRegistry
from kazma.engine.tools.workspace import ToolContext

SPY = Path(__file__).resolve().parent / "mcp_servers" / "spy.py"


@asynccontextmanager
async def _sources(servers: dict[str, list[str]]) -> AsyncIterator[ToolRegistry]:
    """Real servers, each offering the tools named (answering "<name> from <server>"), in one registry."""
    registry = ToolRegistry()
    configs = {
        server: MCPServerConfig(command=sys.executable, args=[str(SPY), server, *tools])
        for server, tools in servers.items()
    }
    sources = MCPSources(configs, registry, lambda _name: DangerLevel.READ)
    await sources.start(wait=60)
    try:
        assert all(c.session is not None for c in sources.connections.values()), [
            c.problem for c in sources.connections.values()
        ]
        yield registry
    finally:
        await sources.stop()


async def _call_as_a_model_would(registry: ToolRegistry, model_facing: str, tmp: Path) -> str:
    result = await registry.execute(registry.canonical(model_facing), {}, ToolContext(tmp, "t"))
    assert result.ok, result.error
    return result.output


async def test_tools_of_two_servers_never_share_a_model_facing_name(tmp_path: Path) -> None:
    # On the names alone, a + x__y and a__x + y are both a__x__y.
    async with _sources({"a": ["x__y"], "a__x": ["y"]}) as registry:
        first = registry.get("a/x__y")
        second = registry.get("a__x/y")
        assert first is not None
        assert second is not None
        one, two = first.spec().name, second.spec().name
        assert one != two
        assert await _call_as_a_model_would(registry, one, tmp_path) == "x__y from a"
        assert await _call_as_a_model_would(registry, two, tmp_path) == "y from a__x"


async def test_tool_names_changed_to_fit_stay_apart(tmp_path: Path) -> None:
    async with _sources({"a": ["x.y", "x_y", "t" * 70, "t" * 69 + "u"]}) as registry:
        names = {registry.get(f"a/{tool}").spec().name for tool in ("x.y", "x_y", "t" * 70, "t" * 69 + "u")}  # type: ignore[union-attr]
        assert len(names) == 4
        assert all(len(name) <= 64 for name in names)
        assert await _call_as_a_model_would(registry, model_name("a", "x.y"), tmp_path) == "x.y from a"
        assert await _call_as_a_model_would(registry, model_name("a", "x_y"), tmp_path) == "x_y from a"


async def test_a_tool_whose_model_name_is_taken_is_refused_with_a_logged_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # "x.y" is offered as a__x_y_<hash>; a second tool named exactly that would take the name over.
    squatter = model_name("a", "x.y").split("__", 1)[1]
    with caplog.at_level(logging.ERROR):
        async with _sources({"a": ["x.y", squatter]}) as registry:
            assert registry.canonical(model_name("a", "x.y")) == "a/x.y"
            assert await _call_as_a_model_would(registry, model_name("a", "x.y"), tmp_path) == "x.y from a"
            assert registry.get(f"a/{squatter}") is None
    taken = [r for r in caplog.records if r.msg == "mcp.tool_name_taken"]
    assert taken
    assert getattr(taken[0], "tool", None) == squatter


def test_model_names_are_injective_on_awkward_names() -> None:
    servers = ["a", "a_", "a__x", "a_x", "a-x", "x" * 32, "b__", "_"]
    tools = ["y", "_y", "x__y", "__y", "y.z", "y_z", "y" * 64, "é", "e", ""]
    seen: dict[str, tuple[str, str]] = {}
    for server in servers:
        for tool in tools:
            name = model_name(server, tool)
            assert name not in seen, (name, seen.get(name), (server, tool))
            assert len(name) <= 64
            assert all(c.isalnum() or c in "_-" for c in name)
            assert name.isascii()
            seen[name] = (server, tool)
