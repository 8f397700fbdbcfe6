"""The hang report: a test that hangs on an ``await`` names that ``await`` before pytest-timeout ends it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.child_env import child_env

HANGING = textwrap.dedent(
    """
    import asyncio

    async def wait_for_the_webhook(event):
        await event.wait()

    async def test_hangs():
        await wait_for_the_webhook(asyncio.Event())
    """
)


def test_a_hung_async_test_prints_the_await_it_waits_on(tmp_path: Path) -> None:
    (tmp_path / "test_hangs.py").write_text(HANGING, encoding="utf-8")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.hang_report",
            "-o",
            "asyncio_mode=auto",
            "--timeout",
            "4",
            "-q",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_hangs.py"),
        ],
        cwd=tmp_path,
        env=child_env({"PATH": "/usr/bin:/bin"}, base={}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0, result.stdout
    report = result.stdout + result.stderr  # pytest shows a failed test's captured stderr in its report
    assert "== hang report: test_hangs.py::test_hangs is still running" in report, report
    assert "test_hangs.py:5 in wait_for_the_webhook" in report, report  # the very await the test hangs on
