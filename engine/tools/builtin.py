"""The built-in tools in one registry: ``shell``, ``read_file``, ``write_file`` and ``http_get``."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kazma.engine.tools.files import ReadFileTool, WriteFileTool
from kazma.engine.tools.http_get import HttpGetTool
from kazma.engine.tools.registry import ToolRegistry
from kazma.engine.tools.sandbox import Sandbox
from kazma.engine.tools.shell import ShellTool


def default_registry(
    *, sandbox: Sandbox | None = None, shell_network: bool = False, hidden: Iterable[Path] = ()
) -> ToolRegistry:
    """The built-in tools with their default limits; ``shell`` in ``sandbox`` (default: bubblewrap when it works).

    ``hidden``: paths a sandboxed command must never see (Kazma's state directory).
    """
    shell = ShellTool(sandbox=sandbox, network=shell_network, hidden_paths=hidden)
    return ToolRegistry([shell, ReadFileTool(), WriteFileTool(), HttpGetTool()])
