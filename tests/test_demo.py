from __future__ import annotations

import io
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kazma.approvals.model import Decision
from kazma.bot.cli.demo import run_demo
from tests.child_env import child_env


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
        "  → Approved. Recorded as demo (cli:demo).",
        "[builder] hello.sh is written and ran once; it printed: hello, world",
        "[kazma] Done:",
    ]
    positions = [next(i for i, line in enumerate(lines) if needle in line) for needle in order]
    assert positions == sorted(positions), positions
    # The card shows the outcome before the builder reports the run the approval let through. The demo presses
    # at once, within the checkpointer's pause of the pass that signed the card's post, so the decision's commit
    # does not sign; the card's witness then cuts the pause short (to WITNESS_INTERVAL). When that was the whole
    # 20 ms pause, the card came after the report (in CI 4 runs in 5: the tool runs bare where bubblewrap cannot
    # make namespaces, and reported 13-24 ms after the press).
    settled = next(i for i, line in enumerate(lines) if "approved by demo (cli:demo) via cli" in line)
    assert positions[4] < settled < positions[6], (settled, positions)
    # the researcher's output reaches the builder fenced as data, not instructions
    assert "from @researcher" in text  # the dispatch carries the step's output under a quiet label
    assert "Untrusted data" not in text
    assert "│ Arguments SHA-256: " in text


async def test_demo_deny_means_the_command_does_not_run() -> None:
    out = io.StringIO()
    assert await run_demo(out=out, interactive=False, decision=Decision.DENY)
    text = out.getvalue()
    assert "  → Denied. Recorded as demo (cli:demo)." in text
    assert "[builder] I did not write the script: Denied by demo (cli:demo). Do not retry this call." in text
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
    found = re.search(r"web console: (http://[^/]+)(/login/local/\S+) — signs one browser in as 'demo'", out.getvalue())
    assert found is not None
    url, link = found.groups()
    jar = aiohttp.CookieJar(unsafe=True)
    async with aiohttp.ClientSession(cookie_jar=jar) as http:
        async with aiohttp.ClientSession() as checker:  # a link checker's HEAD neither uses the link nor signs in
            looked = await checker.head(f"{url}{link}", allow_redirects=False)
            assert (looked.status, sorted(looked.cookies)) == (200, [])
        signed = await http.get(f"{url}{link}")
        assert "demo (web:demo, kazma demo&#x27;s local identity, not a proof)" in await signed.text()
        async with aiohttp.ClientSession() as another:  # the link works once
            assert (await another.get(f"{url}{link}", allow_redirects=False)).status == 410
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
    assert "approved by demo (web:demo) via web" in text  # the terminal's copy of the card settled too


def test_terminal_mode_links_to_nothing_it_does_not_serve(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", "demo", "--terminal"],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "NO_PROXY": "127.0.0.1"},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "http://" not in result.stdout  # no console runs in this mode: nothing may point at one
    assert "│ Full call: not served by `kazma demo --terminal` (the whole call is shown above)" in result.stdout


async def test_after_the_script_the_demo_operator_steers_the_scripted_swarm(tmp_path: Path) -> None:
    import asyncio

    from kazma.adapters.contract import Inbound
    from kazma.adapters.terminal import TerminalAdapter
    from kazma.adapters.web import WebAdapter
    from kazma.bot.app import build_app
    from kazma.bot.cli.demo import CONNECT_A_MODEL, REQUEST, demo_config, scenario
    from kazma.engine.executor import ActionKind
    from kazma.engine.scenario import agent_prompts
    from kazma.engine.swarm.types import TaskStatus

    loaded = demo_config(tmp_path, 0, web=True)  # the console's demo: cli:demo and web:demo, one person
    terminal = TerminalAdapter(out=io.StringIO(), interactive=False, auto=Decision.APPROVE)
    app = await build_app(
        loaded,
        provider=scenario(agent_prompts(loaded.config)),
        adapters=[terminal],
        web=WebAdapter(),
        poll_interval=0.05,
        workspace_root=tmp_path / "ws",
    )
    finished = asyncio.Event()
    app.conversations.listeners.append(lambda action: finished.set() if action.kind is ActionKind.FINISHED else None)
    await app.start()
    try:
        await app.on_inbound(Inbound("cli", terminal.chat, "you-1", "cli:you", "you", REQUEST, mentions=("kazma",)))
        await asyncio.wait_for(finished.wait(), timeout=60)  # the scripted scenario played out
        await app.conversations.drain()
        commands = app.conversations.swarm
        assert commands is not None
        answer = await commands.run(
            "pipeline quick write a haiku", actor="web:demo", platform="web", chat="console", is_admin=True
        )
        assert "operators are configured" not in answer, answer
        (task,) = await app.swarm.store.list(limit=5)
        done = await app.swarm.wait(task.id, 30)
        assert done is not None
        assert done.status is TaskStatus.SUCCEEDED, done
        assert "Built “write a haiku” in the workspace." in str((done.result or {}).get("output"))
        # the lead, its script used up, says how to connect a real model, as often as it is asked
        lead = app.conversations.lead
        for _ in range(2):
            reply = await app.provider.complete([{"role": "system", "content": lead.system_prompt}])
            assert reply.content == CONNECT_A_MODEL
    finally:
        await app.stop()


def _demo_on_a_terminal(tmp_path: Path, *options: str) -> tuple[subprocess.Popen[bytes], int]:
    """`kazma demo` with a terminal for its standard input (so it serves the console and lingers), as typed."""
    import os
    import pty

    master, slave = pty.openpty()
    env = child_env(base={"PATH": "/usr/bin:/bin", "NO_PROXY": "127.0.0.1"})
    demo = subprocess.Popen(
        [sys.executable, "-m", "kazma.bot.cli", "demo", "--no-browser", "--port", "0", *options],
        cwd=tmp_path, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
    )  # fmt: skip
    os.close(slave)
    return demo, master


def _read_until(
    master: int, wanted: bytes, seen: bytearray, *, answer: bytes = b"", times: int = 1, unless: bytes = b"\x00"
) -> None:
    import os
    import select
    import time

    deadline = time.monotonic() + 90
    answered = False
    while seen.count(wanted) < times and unless not in seen:
        assert time.monotonic() < deadline, bytes(seen[-2000:])
        ready, _, _ = select.select([master], [], [], 1)
        if ready:
            try:
                seen += os.read(master, 65536)
            except OSError:  # the terminal closed: the demo ended
                break
        if answer and not answered and b"[a/d]" in seen:
            os.write(master, answer)
            answered = True
    assert seen.count(wanted) >= times or unless in seen, bytes(seen[-2000:])


@pytest.mark.parametrize(
    ("sig", "when", "code", "said"),
    [
        (signal.SIGTERM, b"press Ctrl-C to leave", 0, b"kazma demo stopped: "),
        (signal.SIGINT, b"press Ctrl-C to leave", 0, b"kazma demo stopped: "),
        # pressed before the card was: the scenario did not end, and that is no success
        (signal.SIGINT, b"[a/d]", 1, b"kazma demo interrupted before the scenario ended: "),
    ],
)
def test_the_console_demo_stops_cleanly_on_a_signal_and_says_so(
    tmp_path: Path, sig: signal.Signals, when: bytes, code: int, said: bytes
) -> None:
    # SIGTERM (a terminal closing, `timeout`, a container stopping) killed it where it stood: exit -15 and its
    # temporary directory, with a store and a decision key, left in /tmp. Ctrl-C left without a word, and with exit
    # 0 also when the scenario had not ended.
    import re

    demo, master = _demo_on_a_terminal(tmp_path)
    seen = bytearray()
    try:
        _read_until(master, when, seen, answer=b"a\n" if when != b"[a/d]" else b"")
        demo.send_signal(sig)
        assert demo.wait(timeout=60) == code, bytes(seen[-2000:])
        _read_until(master, b"temporary directory removed", seen)
    finally:
        if demo.poll() is None:
            demo.kill()
        import os

        os.close(master)
    assert said in seen
    folder = re.search(rb"store: (\S+)/state/kazma\.db \(temporary\)", seen)
    assert folder is not None
    assert not Path(folder.group(1).decode()).exists()


def test_only_a_or_approve_at_the_terminal_approves(tmp_path: Path) -> None:
    # Every answer but d/deny was read as Approve: "n" (for no), an empty Enter or Ctrl-D let the shell call run.
    import os

    demo, master = _demo_on_a_terminal(tmp_path)
    seen = bytearray()
    try:
        _read_until(master, b"[a/d]", seen)
        for asked, wrong in enumerate((b"n\n", b"no\n", b"\n"), start=1):
            os.write(master, wrong)
            _read_until(master, b"[a/d]", seen, times=asked + 1, unless=b"Approved")  # asked again, nothing pressed
            assert b"Approved" not in seen, bytes(seen[-2000:])
        os.write(master, b"d\n")
        _read_until(master, b"Denied. Recorded as demo (cli:demo).", seen)
        _read_until(master, b"press Ctrl-C to leave", seen)
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=60) == 0
    finally:
        if demo.poll() is None:
            demo.kill()
        os.close(master)
    assert b"it printed: hello, world" not in seen


def test_the_end_of_input_at_the_terminal_only_prompt_denies_at_once(tmp_path: Path) -> None:
    # Ctrl-D at `kazma demo --terminal`'s prompt pressed nothing and said nothing: with no console served there,
    # the demo sat silent until the card's deadline (five minutes), with nothing left to type into.
    import os

    demo, master = _demo_on_a_terminal(tmp_path, "--terminal")
    seen = bytearray()
    try:
        _read_until(master, b"[a/d]", seen)
        os.write(master, b"\x04")
        _read_until(master, b"Denied. Recorded as demo (cli:demo).", seen)
        assert demo.wait(timeout=60) == 0
    finally:
        if demo.poll() is None:
            demo.kill()
        os.close(master)
    assert b"(end of input: pressing deny, nothing else can here)" in seen
    assert b"it printed: hello, world" not in seen


@pytest.mark.parametrize("options", [(), ("--terminal",)])
def test_kazma_demo_runs_with_standard_input_closed(tmp_path: Path, options: tuple[str, ...]) -> None:
    # `kazma demo 0<&-` (no standard input at all: sys.stdin is None) ended in AttributeError: 'NoneType' object
    # has no attribute 'isatty', before anything was played.
    import shlex

    command = shlex.join([sys.executable, "-m", "kazma.bot.cli", "--log-level", "warning", "demo", *options])
    result = subprocess.run(
        ["/bin/sh", "-c", f"exec {command} 0<&-"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(base={"PATH": "/usr/bin:/bin", "NO_PROXY": "127.0.0.1"}),
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "it printed: hello, world" in result.stdout
