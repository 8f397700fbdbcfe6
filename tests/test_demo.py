from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from kazma.approvals.model import Decision
from kazma.bot.demo import run_demo


async def test_demo_plays_the_whole_loop_and_approves() -> None:
    out = io.StringIO()
    assert await run_demo(out=out, interactive=False)
    text = out.getvalue()
    assert "model: scripted (demo — no model is called)" in text
    lines = text.splitlines()
    order = [
        "[you] @kazma please write",
        "[kazma] @researcher Find the simplest portable way",
        "[researcher] A POSIX sh script",
        "[kazma] @builder Write hello.sh",
        "│ Approval needed: shell",
        "  → Approved. Recorded as cli:demo.",
        "approved by cli:demo via cli",
        "[builder] hello.sh is written and ran once; it printed: hello, world",
        "[kazma] Done:",
    ]
    positions = [next(i for i, line in enumerate(lines) if needle in line) for needle in order]
    assert positions == sorted(positions), positions
    # the researcher's output reaches the builder fenced as data, not instructions
    assert "[Untrusted data from step 1 (researcher)" in text
    assert "│ Arguments SHA-256: " in text


async def test_demo_deny_means_the_command_does_not_run() -> None:
    out = io.StringIO()
    assert await run_demo(out=out, interactive=False, decision=Decision.DENY)
    text = out.getvalue()
    assert "  → Denied. Recorded as cli:demo." in text
    assert "[builder] I did not write the script: Denied by cli:demo. Do not retry this call." in text
    assert "printed: hello, world" not in text
    assert "The plan ended without a working script" in text


def test_kazma_demo_command_runs_with_no_tokens_and_no_model(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", "--log-level", "warning", "demo"],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "NO_PROXY": "127.0.0.1"},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "it printed: hello, world" in result.stdout
    assert not (tmp_path / ".kazma").exists()  # the demo keeps to its temporary directory


async def test_web_demo_serves_the_console_and_a_browser_press_decides() -> None:
    import asyncio
    import re

    import aiohttp

    out = io.StringIO()
    demo = asyncio.create_task(run_demo(out=out, interactive=False, web=True, web_port=0))
    async with asyncio.timeout(60):
        while "web console: " not in out.getvalue():
            await asyncio.sleep(0.05)
    found = re.search(r"web console: (\S+)/login — log in as 'demo' with token (\S+)", out.getvalue())
    assert found is not None
    url, token = found.groups()
    jar = aiohttp.CookieJar(unsafe=True)
    async with aiohttp.ClientSession(cookie_jar=jar) as http:
        page = await (await http.get(f"{url}/login")).text()
        login_csrf = re.search(r'name="csrf" value="([^"]+)"', page)
        assert login_csrf is not None
        await http.post(f"{url}/login", data={"name": "demo", "token": token, "csrf": login_csrf.group(1)})
        async with asyncio.timeout(60):
            while True:
                console = await (await http.get(f"{url}/")).text()
                if "/decide" in console:
                    break
                await asyncio.sleep(0.1)
        csrf = re.search(r'name="kazma-csrf" content="([^"]+)"', console)
        request = re.search(r"/approvals/([A-Za-z0-9_-]+)/decide", console)
        assert csrf is not None
        assert request is not None
        await http.post(
            f"{url}/approvals/{request.group(1)}/decide",
            data={"decision": "approve", "csrf": csrf.group(1), "next": "/"},
        )
    assert await asyncio.wait_for(demo, timeout=60)
    text = out.getvalue()
    assert "approved by web:demo via web" in text  # the terminal's copy of the card settled too
