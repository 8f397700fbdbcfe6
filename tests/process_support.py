"""Running `kazma run` as a real child process for crash tests."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.child_env import child_env

REPO = Path(__file__).resolve().parent.parent


async def run_kazma(config: Path, log: Path) -> asyncio.subprocess.Process:
    """`kazma -c CONFIG run` with JSON logs appended to ``log`` and fast polling of the outbox."""
    env = child_env({"NO_PROXY": "127.0.0.1,localhost"})
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kazma.bot.cli", "-c", str(config), "--log-format", "json", "run",
        "--poll-interval", "0.1",
        stdout=asyncio.subprocess.DEVNULL, stderr=log.open("ab"), env=env,
    )  # fmt: skip
