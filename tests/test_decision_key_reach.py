"""The decision key and the audit key are out of every tool's reach: an MCP server Kazma starts (a real SDK server,
placed and sandboxed as build_app does) never sees them: not in its environment, not in Kazma's through /proc, not
their files.

The shell's side is attacked in test_sandbox (Kazma's environment through /proc) and test_trust_tools (the key
file, as Kazma wires the shell); ``kazma.yaml`` can neither hand the variable to a server nor substitute it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kazma.config import ConfigError, load_config_text
from kazma.config.keyring import AUDIT_KEYS, DECISION_KEYS, KeySpec
from kazma.engine.tools.mcp_launch import places_for
from tests.child_env import child_env

SNOOP = Path(__file__).resolve().parent / "mcp_servers" / "snoop.py"
KAZMA_CHILD = """
import asyncio, json, sys
from kazma.bot.keys import decision_keys_folder
from kazma.config import load_config_text
from kazma.config.models import MCPServerConfig
from kazma.engine.tools.mcp_launch import places_for
from kazma.engine.tools.mcp_tools import MCPConnection

async def main() -> None:
    snoop, store, purpose = sys.argv[1:4]
    config = load_config_text(f"store: {{path: '{store}'}}", environ={}).config
    key_file = str(decision_keys_folder(config) / purpose)
    server = MCPServerConfig(command=sys.executable, args=[snoop])
    connection = MCPConnection("snoop", server, places=places_for(config))  # as build_app places servers
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
# What each keyring holds in the variable and in the file (an audit key is an Ed25519 seed: 43 characters).
SECRETS = {DECISION_KEYS.purpose: ("v" * 40, "f" * 40), AUDIT_KEYS.purpose: ("v" * 43, "f" * 43)}
SPECS = pytest.mark.parametrize("spec", [DECISION_KEYS, AUDIT_KEYS], ids=lambda spec: spec.purpose)


async def _snooped(tmp_path: Path, spec: KeySpec = DECISION_KEYS) -> dict[str, Any]:
    """A stand-in for ``kazma run`` started with the key in its environment and a key file beside its store,
    starting the snoop server and calling it once: what the server saw."""
    in_env, in_file = SECRETS[spec.purpose]
    keys = tmp_path / "state-keys"  # where kazma run makes it, beside the store's folder tmp_path/state
    keys.mkdir(mode=0o700)
    spec.file(keys).write_text(f"k1:{in_file}\n")
    spec.file(keys).chmod(0o600)
    script = tmp_path / "kazma_child.py"
    script.write_text(KAZMA_CHILD)
    env = child_env({spec.env: f"k1:{in_env}"})

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(script), str(SNOOP), str(tmp_path / "state" / "kazma.db"), spec.purpose],
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


@SPECS
async def test_an_mcp_servers_environment_never_holds_the_key(tmp_path: Path, spec: KeySpec) -> None:
    seen = await _snooped(tmp_path, spec)
    assert "PATH" in seen["env"]  # the server did report its environment
    assert spec.env not in seen["env"]
    assert SECRETS[spec.purpose][0] not in json.dumps(seen["env"])


@SPECS
async def test_an_mcp_server_cannot_read_the_key_through_proc_or_the_key_file(tmp_path: Path, spec: KeySpec) -> None:
    seen = await _snooped(tmp_path, spec)
    assert SECRETS[spec.purpose][0] not in json.dumps(seen["proc"])
    assert SECRETS[spec.purpose][1] not in seen["file"]
    assert seen["file"].startswith("<")  # not there at all: <FileNotFoundError>


def test_the_keys_folder_is_hidden_from_every_mcp_server(tmp_path: Path) -> None:
    # Also where the sandbox binds a folder around it (a server's interpreter or packages under the state
    # volume): the keys folder is covered there, as the store's folder is.
    config = load_config_text(f"store: {{path: '{tmp_path}/state/kazma.db'}}", environ={}).config
    assert (tmp_path / "state-keys").resolve() in places_for(config).hidden


@pytest.mark.parametrize("key", ["read_only", "writable"])
@pytest.mark.parametrize("where", ["{tmp}", "{tmp}/state-keys", "{tmp}/state-keys/decision"])
def test_no_folder_given_to_an_mcp_server_shows_the_decision_keys(tmp_path: Path, key: str, where: str) -> None:
    yaml = (
        f"store: {{path: '{tmp_path}/state/kazma.db'}}\n"
        f"mcp_servers: {{x: {{command: a, {key}: ['{where.format(tmp=tmp_path)}']}}}}\n"
    )
    # (A writable folder around both is refused for the store's folder first.)
    with pytest.raises(ConfigError, match=r"would let the server (read the decision keys|reach the store's folder)"):
        load_config_text(yaml, environ={})


@SPECS
@pytest.mark.parametrize(
    "yaml",
    [
        "mcp_servers: {x: {command: a, env: [VARIABLE]}}",
        "mcp_servers: {x: {url: 'http://127.0.0.1:1/mcp', headers: {X-Key: VARIABLE}}}",
        "agents: {lead: {system_prompt: 'the key is ${VARIABLE}'}}",
        "audit: {sink: {webhook: 'https://audit.example/in', headers: {X-Key: '${VARIABLE}'}}}",
    ],
)
def test_kazma_yaml_can_hand_the_key_to_nothing(yaml: str, spec: KeySpec) -> None:
    with pytest.raises(ConfigError, match=rf"{spec.env}.* holds Kazma's own keys"):
        load_config_text(yaml.replace("VARIABLE", spec.env), environ={spec.env: ENV_KEY})
