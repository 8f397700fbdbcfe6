"""SIGKILL while a /swarm worker's approved shell call runs: after the restart every surface that shows the task says
the call may have run, and ``/swarm retry`` asks before running it again.

`kazma run` is a real process with the real Telegram adapter and model provider on their wire fakes; the builder's
shell call is approved on its card and killed with the whole process mid-run (it writes a line, then sleeps). The
restart's report, ``/swarm status`` in chat and ``kazma swarm status`` (another process) must each say "may have
run"; the first ``/swarm retry`` asks, and nothing runs again unasked. (A cancel and a deadline cutting the call off
in-process: tests/test_swarm_endings.py, which also reads the console's dashboard and ``check_swarm_task``.)
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest

from kazma.config.store.database import connect
from kazma.engine.swarm.store import SwarmTaskStore
from kazma.engine.swarm.types import TaskStatus
from tests.child_env import child_env
from tests.fakes.openai import Completion, FakeOpenAI, FakeToolCall
from tests.fakes.telegram import FakeTelegram
from tests.process_support import run_kazma

CHAT = -1001
STARTED = "started.txt"
MAY_HAVE_RUN = "may have run: shell (started, not finished)"


def _said(telegram: FakeTelegram, words: str) -> list[str]:
    return [m.text for m in telegram.bot_messages(CHAT) if words in m.text]


async def _ask(telegram: FakeTelegram, text: str, answered: str) -> str:
    """Send ``text`` in the chat; the first new bot message containing ``answered``."""
    before = len(telegram.bot_messages(CHAT))
    telegram.push_message(CHAT, 111, text, username="ops")
    await telegram.wait_until(lambda: any(answered in m.text for m in telegram.bot_messages(CHAT)[before:]), timeout=60)
    return next(m.text for m in telegram.bot_messages(CHAT)[before:] if answered in m.text)


@pytest.mark.slow
async def test_sigkill_mid_shell_says_may_have_run_everywhere_and_a_retry_asks(tmp_path: Path) -> None:
    telegram, model = FakeTelegram(), FakeOpenAI(models=("llama3.1",))
    await telegram.start()
    await model.start()
    config, log, store = tmp_path / "kazma.yaml", tmp_path / "kazma.log", tmp_path / "state" / "k.db"
    store.parent.mkdir()
    config.write_text(
        f"store: {{path: '{store}'}}\nweb: {{port: 0}}\n"
        f"tools: {{workspace_root: '{tmp_path / 'ws'}'}}\n"
        f"model: {{base_url: '{model.base_url}', timeout_seconds: 600, max_retries: 0}}\n"
        f"platforms: {{telegram: {{token: '{telegram.token}', api_base_url: '{telegram.base_url}',"
        f" chats: [{CHAT}], home_chat: {CHAT}, admins: [111]}}}}\n"
    )
    model.script(Completion(tool_calls=(FakeToolCall("shell", f'{{"command": "echo x >> {STARTED}; sleep 120"}}'),)))
    conn = None
    try:
        first = await run_kazma(config, log)
        try:
            await telegram.wait_until(lambda: len(telegram.calls_to("getUpdates")) > 0, timeout=60)
            telegram.push_message(CHAT, 111, "/swarm dispatch builder clean the build folder", username="ops")
            await telegram.wait_until(lambda: any(m.buttons for m in telegram.bot_messages(CHAT)), timeout=60)
            card = next(m for m in telegram.bot_messages(CHAT) if m.buttons)
            approve = str(next(b["callback_data"] for b in card.buttons if str(b["callback_data"]).endswith(":a")))
            telegram.push_callback(CHAT, card.message_id, 111, approve)
            async with asyncio.timeout(60):  # the shell call runs: its first line is written
                while not list((tmp_path / "ws").rglob(STARTED)):
                    await asyncio.sleep(0.05)
        finally:
            first.send_signal(signal.SIGKILL)
            await first.wait()
        conn = await connect(store)
        tasks = SwarmTaskStore(conn)
        (running,) = await tasks.list(TaskStatus.RUNNING)  # on disk, RUNNING, when the process died
        second = await run_kazma(config, log)
        try:
            await telegram.wait_until(lambda: bool(_said(telegram, "was interrupted")), timeout=60)
            (report,) = _said(telegram, "was interrupted")
            assert MAY_HAVE_RUN in report, report
            status = await _ask(telegram, f"/swarm status {running.id}", running.id)
            assert MAY_HAVE_RUN in status, status
            asked = await _ask(telegram, f"/swarm retry {running.id}", "again")
            assert MAY_HAVE_RUN in asked, asked  # it asks, saying why
            assert f"Send /swarm retry {running.id} again" in asked, asked
            assert await tasks.count(TaskStatus.RUNNING) == 0  # nothing ran again unasked
        finally:
            if second.returncode is None:  # (it ended by itself when its start failed)
                second.send_signal(signal.SIGTERM)
            await asyncio.wait_for(second.wait(), timeout=60)
        assert second.returncode == 0, log.read_text()[-3000:]
        env = child_env({"NO_PROXY": "127.0.0.1,localhost"})
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kazma.bot.cli", "-c", str(config), "swarm", "status", running.id,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=str(tmp_path),
        )  # fmt: skip
        out, err = await asyncio.wait_for(cli.communicate(), timeout=120)
        assert cli.returncode == 0, err.decode()[-2000:]
        assert MAY_HAVE_RUN in out.decode(), out.decode()
        lines = sum(len(p.read_text().splitlines()) for p in (tmp_path / "ws").rglob(STARTED))
        assert lines == 1  # the call ran once, never again
    finally:
        if conn is not None:
            await conn.close()
        await model.stop()
        await telegram.stop()
