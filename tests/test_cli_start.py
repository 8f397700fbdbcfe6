"""`kazma --version` and `--help` import only what they print; each command loads its own module."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kazma.bot.cli import COMMANDS, load_command

HEAVY = ("kazma.bot.app", "kazma.config.models", "pydantic", "structlog", "telegram", "discord", "slack_bolt", "mcp")

PROBE = """
import sys
from kazma.bot.cli import main
try:
    main([{arg!r}], prog_name="kazma")
except SystemExit:
    pass
print(",".join(sorted(m for m in sys.modules if m.split(".")[0] in {{"kazma", "pydantic", "structlog", "telegram",
      "discord", "slack_bolt", "mcp"}})))
"""


@pytest.mark.parametrize("arg", ["--version", "--help"])
def test_version_and_help_import_nothing_heavy(arg: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(arg=arg)], capture_output=True, text=True, check=True, timeout=60
    )
    lines = done.stdout.strip().splitlines()
    loaded = set(lines[-1].split(","))
    assert "kazma.bot.cli" in loaded
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
    if arg == "--version":
        assert lines[0].startswith("kazma, version ")
    else:
        assert all(name in done.stdout for name in COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_help_line_is_the_command_s_own(name: str) -> None:
    command = load_command(name)
    assert COMMANDS[name][2] == command.get_short_help_str(limit=70)


def test_a_command_loaded_twice_keeps_one_pair_of_log_options() -> None:
    load_command("doctor")
    command = load_command("doctor")
    assert [p.name for p in command.params].count("log_level") == 1
