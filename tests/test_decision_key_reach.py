"""The decision key is out of every tool's reach: an MCP server Kazma starts (a real SDK server) never sees it.

The shell's side is attacked in test_sandbox (Kazma's environment through /proc) and test_trust_tools (the key
file, as Kazma wires the shell); ``kazma.yaml`` can neither hand the variable to a server nor substitute it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kazma.config import ConfigError, load_config_text
from tests.process_support import REPO

SNOOP = Path(__file__).resolve().parent / "mcp_servers" / "snoop.py"
KAZMA_CHILD = """
import asyncio, json, sys
from kazma.config.models import MCPServerConfig
from kazma.engine.mcp_tools import MCPConnection

async def main() -> None:
    snoop, key_file = sys.argv[1:3]
    connection = MCPConnection("snoop", MCPServerConfig(command=sys.executable, args=[snoop]))
    connection.start()
    try:
        assert await connection.wait_ready(60), connection.problem
        result = await connection.call("snoop", {"path": key_file})
    finally:
        await connection.stop()
    print(json.dumps({"ok": result.ok, "output": result.output, "error": result.error}))

asyncio.run(main())
"""
ENV_KEY = "k1:" + "v" * 40
FILE_KEY = "k1:" + "f" * 40


async def _snooped(tmp_path: Path) -> dict[str, Any]:
    """A stand-in for ``kazma run`` started with the key in its environment and a key file beside its store,
    starting the snoop server and calling it once: what the server saw."""
    keys = tmp_path / ".kazma-keys"
    keys.mkdir(mode=0o700)
    (keys / "decision").write_text(FILE_KEY + "\n")
    (keys / "decision").chmod(0o600)
    script = tmp_path / "kazma_child.py"
    script.write_text(KAZMA_CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO), "KAZMA_DECISION_KEY": ENV_KEY}

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(script), str(SNOOP), str(keys / "decision")],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    done = await asyncio.to_thread(run)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.splitlines()[-1])
    assert answer["ok"], answer
    text = str(answer["output"])
    seen: dict[str, Any] = json.loads(text[text.index("{") : text.rindex("}") + 1])
    return seen


async def test_an_mcp_servers_environment_never_holds_the_key(tmp_path: Path) -> None:
    seen = await _snooped(tmp_path)
    assert "PATH" in seen["env"]  # the server did report its environment
    assert "KAZMA_DECISION_KEY" not in seen["env"]
    assert "v" * 40 not in json.dumps(seen["env"])


@pytest.mark.xfail(
    strict=True,
    reason="a stdio MCP server still runs unsandboxed as Kazma's user (issue 25, row 2: the MCP sandbox is built "
    "on another branch); with it, this passes and the marker goes",
)
async def test_an_mcp_server_cannot_read_the_key_through_proc_or_the_key_file(tmp_path: Path) -> None:
    seen = await _snooped(tmp_path)
    assert "v" * 40 not in json.dumps(seen["proc"])
    assert "f" * 40 not in seen["file"]


@pytest.mark.parametrize(
    "yaml",
    [
        "mcp_servers: {x: {command: a, env: [KAZMA_DECISION_KEY]}}",
        "mcp_servers: {x: {url: 'http://127.0.0.1:1/mcp', headers: {X-Key: KAZMA_DECISION_KEY}}}",
        "agents: {lead: {system_prompt: 'the key is ${KAZMA_DECISION_KEY}'}}",
    ],
)
def test_kazma_yaml_can_hand_the_key_to_nothing(yaml: str) -> None:
    with pytest.raises(ConfigError, match=r"KAZMA_DECISION_KEY.* holds Kazma's own keys"):
        load_config_text(yaml, environ={"KAZMA_DECISION_KEY": ENV_KEY})
