"""An stdio MCP server's connection leaves nothing running behind it, also when the server left on its own.

The transport killed the server's process group only while its leader still ran: a server that exited when its
stdin closed (as MCP servers do) left whatever it had started in the background running, after every
connection and every restart of one.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import anyio

from kazma.engine.tools.mcp_launch import Launch
from kazma.engine.tools.mcp_stdio import bounded_stdio_client


def alive_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


async def test_what_a_server_started_in_the_background_is_gone_when_its_connection_closes(tmp_path: Path) -> None:
    marker = f"kazma-mcp-child-{uuid.uuid4().hex}"
    # The "server" starts a background child, then leaves as soon as its stdin is closed.
    script = f"exec -a {marker} sleep 300 & echo started >&2; cat > /dev/null"
    launch = Launch(["/bin/bash", "-c", script], env={"PATH": os.environ["PATH"]}, cwd=tmp_path, sandboxed=False)
    try:
        async with bounded_stdio_client(launch, server="probe", max_message_bytes=1 << 20):
            with anyio.fail_after(20):
                while not alive_with(marker):
                    await anyio.sleep(0.01)
        with anyio.fail_after(20):
            while alive_with(marker):
                await anyio.sleep(0.01)
        assert alive_with(marker) == []
    finally:
        for pid in alive_with(marker):
            os.kill(pid, signal.SIGKILL)
