"""`kazma --version` and `--help` import only what they print; each command loads its own module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kazma.bot.cli import COMMANDS, load_command

HEAVY = ("kazma.bot.app", "kazma.config.models", "pydantic", "structlog", "telegram", "discord", "slack_bolt", "mcp")

PROBE = """
import sys
from pathlib import Path
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


GC_PROBE = """
import gc, sys
from kazma.bot.cli import main
gc.set_threshold(700, 10, 10)
young = []  # the young generation's size when the app's module is imported
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "kazma.bot.app":
            young.append(gc.get_threshold()[0])
sys.meta_path.insert(0, Watch())
try:
    main(["-c", sys.argv[1], "run"], prog_name="kazma")
except SystemExit as exc:
    code = exc.code
from kazma.bot.start_gc import START_YOUNG
print(code, young == [START_YOUNG], gc.get_threshold())
"""


def test_run_starts_with_a_large_young_generation_and_a_failed_start_gives_the_collector_back(tmp_path: Path) -> None:
    """`kazma run` collects young garbage every 300,000 allocations while it starts (kazma.bot.start_gc); a start that
    ends before it serves (here its configuration is missing) leaves the thresholds as they were."""
    done = subprocess.run(
        [sys.executable, "-c", GC_PROBE, str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.stdout.strip().splitlines()[-1] == "2 True (700, 10, 10)", done.stdout + done.stderr[-3000:]
