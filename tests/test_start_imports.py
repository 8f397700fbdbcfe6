"""What building the platforms imports: a library's optional parts the settings never use stay out.

python-telegram-bot imports its webhook server (Tornado) whenever the
[webhooks] extra is installed, as it is with Kazma; long polling never uses it.
Each case is a fresh interpreter (this test process has imported everything).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.process_support import REPO


def _probe(script: str, *args: str) -> str:
    """The last line a fresh interpreter running ``script`` (with ``args``) printed; it must exit cleanly."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120, check=False, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


PROBE = """
import sys
from kazma.bot.app import build_adapters
from kazma.config import load_config_text
loaded = load_config_text(sys.argv[1], environ={})
adapters = build_adapters(loaded)
from telegram.ext._updater import WEBHOOKS_AVAILABLE
print(sorted(a.name for a in adapters), "tornado" in sys.modules, WEBHOOKS_AVAILABLE)
"""


def _built(tmp: Path, telegram: str) -> str:
    yaml = (
        f"store: {{path: '{tmp / 'k.db'}'}}\n"
        f"platforms:\n  telegram: {{token: '1:t', chats: [-1001], home_chat: -1001, admins: [111]{telegram}}}\n"
    )
    return _probe(PROBE, yaml)


def test_long_polling_does_not_import_the_webhook_server(tmp_path: Path) -> None:
    pytest.importorskip("tornado", reason="python-telegram-bot[webhooks] is not installed here")
    assert _built(tmp_path, "") == "['telegram'] False False"


DISCORD_PROBE = """
import sys
from kazma.bot.app import build_adapters
from kazma.config import load_config_text
adapters = build_adapters(load_config_text(sys.argv[1], environ={}))
import discord.voice_client
print(sorted(a.name for a in adapters), "nacl" in sys.modules, discord.voice_client.has_nacl)
"""


def test_discord_does_not_import_its_voice_library(tmp_path: Path) -> None:
    """discord.py imports PyNaCl for voice whenever it is installed; Kazma never joins a voice channel."""
    pytest.importorskip("nacl", reason="PyNaCl is not installed here")
    yaml = (
        f"store: {{path: '{tmp_path / 'k.db'}'}}\n"
        "platforms:\n  discord: {token: 'x.y.z', channels: [123456789012345678], home_channel: 123456789012345678,"
        " admins: [223456789012345678]}\n"
    )
    assert _probe(DISCORD_PROBE, yaml) == "['discord'] False False"


def test_a_webhook_still_has_its_server(tmp_path: Path) -> None:
    pytest.importorskip("tornado", reason="python-telegram-bot[webhooks] is not installed here")
    hook = ", mode: webhook, webhook: {url: 'https://bot.example.org/telegram', secret_token: 's3cret-token'}"
    assert _built(tmp_path, hook) == "['telegram'] True True"


def test_the_run_commands_module_leaves_doctors_checks_out() -> None:
    """`kazma run` imports the module of the commands that run Kazma; `kazma doctor`'s checks (the audit
    verifier among them) are imported by that command alone."""
    probe = "import sys, kazma.bot.cli.core_cli; print(sorted(m for m in sys.modules if '.cli.' in m and 'check' in m))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_telegram_does_not_import_cryptography_for_its_passports(tmp_path: Path) -> None:
    """python-telegram-bot imports cryptography whenever it is installed, for Telegram Passport data Kazma never
    decrypts; cryptography (installed for the audit signatures) then held about 9 MB of every idle `kazma run`."""
    pytest.importorskip("cryptography", reason="cryptography is not installed here")
    probe = PROBE.replace('"tornado" in sys.modules', '"cryptography" in sys.modules')
    for telegram in ("", ", mode: webhook, webhook: {url: 'https://bot.example.org/telegram', secret_token: 's3cret'}"):
        yaml = (
            f"store: {{path: '{tmp_path / 'k.db'}'}}\n"
            f"platforms:\n  telegram: {{token: '1:t', chats: [-1001], home_chat: -1001, admins: [111]{telegram}}}\n"
        )
        last = _probe(probe, yaml)
        assert last.startswith("['telegram'] False"), (telegram, last)


SIGNER_PROBE = """
import sys
from kazma.approvals.checkpoints import AuditSigner, PublicKeys
from kazma.config.keyring import AUDIT_KEYS, Keyring
signer = AuditSigner(Keyring.of(AUDIT_KEYS, ("a1", AUDIT_KEYS.generate())))
before = "cryptography" in sys.modules
checkpoint = signer.sign("head", 1, 7, "ab" * 32, 1700000000.0)
keys = signer.public_keys()
again = PublicKeys.parse(keys.text(), source="probe")
tampered = checkpoint.__class__(**{**checkpoint.__dict__, "seq": 8})
print(before, "cryptography" in sys.modules, keys.problem(checkpoint), again.problem(checkpoint),
      again.problem(tampered) is not None, "bcrypt" in sys.modules)
"""


def test_the_audit_signer_imports_cryptography_at_its_first_signature() -> None:
    """A signer is made at every start; cryptography (its Ed25519) is imported by the first checkpoint it signs,
    and what it signs verifies as before: with its public keys, also written out and read back."""
    assert _probe(SIGNER_PROBE) == "False True None None True False"


RUN_PROBE = """
import sys
import kazma.bot.cli.core_cli
from kazma.bot.app import build_adapters
from kazma.config import load_config_text
adapters = build_adapters(load_config_text(sys.argv[1], environ={}))
held = [m for m in sys.modules if m.startswith(("kazma.bot.cli.demo", "kazma.engine.tools.mcp_", "anyio",
                                                "slack_bolt.adapter.socket_mode", "slack_sdk.socket_mode",
                                                "kazma.engine.swarm.grammar", "kazma.bot.console.api_models"))]
print(sorted(a.name for a in adapters), sorted(held))
"""


def test_a_start_without_mcp_or_socket_mode_leaves_their_machinery_out(tmp_path: Path) -> None:
    """What `kazma run` imports before it is ready, with Slack over HTTP and no MCP server configured: not the
    demo's scenario, not the MCP client (its stdio launcher, anyio), not Slack's socket-mode client, not the
    swarm's command grammar, not the API's pydantic models (nor the OpenAPI document generated from them): each is
    imported where it is first used."""
    yaml = (
        f"store: {{path: '{tmp_path / 'k.db'}'}}\n"
        "platforms:\n  slack: {bot_token: 'xoxb-kazma-fake-token', signing_secret: 'kazma-fake-signing-secret',"
        " channels: [C0HOME0001], home_channel: C0HOME0001, admins: [U0ADMIN01]}\n"
    )
    assert _probe(RUN_PROBE, yaml) == "['slack'] []"
