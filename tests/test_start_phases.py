"""What runs beside what while Kazma starts, and what a start leaves for after it serves.

bubblewrap's trial run (a process of its own) used to run inside the event loop, after the store opened
and the platforms' libraries were imported: everything on the loop waited for it. It runs on a thread from
the start of the build now.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kazma.bot.app import build_app
from kazma.config import load_config_text
from kazma.engine.model import ScriptedProvider
from kazma.engine.tools.shell import ShellTool

# A bwrap that says it started, then succeeds only once something else answered it: only a loop that is free
# while the trial runs can (bounded: it gives up after about five seconds and fails the trial).
BWRAP = """#!/bin/sh
: > "{started}"
n=0
while [ ! -e "{answered}" ]; do
    n=$((n + 1))
    [ "$n" -gt 500 ] && exit 1
    sleep 0.01
done
exit 0
"""


async def test_bubblewraps_trial_run_does_not_hold_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, answered = tmp_path / "started", tmp_path / "answered"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    bwrap = bin_dir / "bwrap"
    bwrap.write_text(BWRAP.format(started=started, answered=answered))
    bwrap.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    loaded = load_config_text(f"store: {{path: '{tmp_path / 'state' / 'k.db'}'}}\n", environ={})

    async def answer() -> None:  # on the event loop, while the trial runs
        async with asyncio.timeout(30):
            while not started.exists():  # another process makes it
                await asyncio.sleep(0.01)
        answered.touch()

    answering = asyncio.create_task(answer())
    app = await build_app(loaded, adapters=[], provider=ScriptedProvider([]), workspace_root=tmp_path / "ws")
    try:
        await answering
        shell = app.conversations.runner.registry.get("shell")
        assert isinstance(shell, ShellTool)
        assert (shell.sandbox.binary, shell.sandbox.problem) == (str(bwrap), None)
    finally:
        await app.stores.close()
