"""Logging on the command line: options after the subcommand, a quiet demo, and no secret in any log line."""

from __future__ import annotations

import asyncio
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
import pytest

from kazma.bot.cli import main
from kazma.bot.logging import redact, redact_secret
from tests.fakes.telegram import FakeTelegram
from tests.test_cli import CLEAN_ENV, run

REPO = Path(__file__).resolve().parent.parent


def _commands(command: click.Command, path: str = "kazma") -> list[tuple[str, click.Command]]:
    found = [(path, command)]
    if isinstance(command, click.Group):
        ctx = click.Context(command)  # through click's own lookup: the top level loads its commands lazily
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            assert sub is not None
            found += _commands(sub, f"{path} {name}")
    return found


def test_every_subcommand_takes_the_log_options_after_its_name() -> None:
    missing = [
        path
        for path, command in _commands(main)
        if not {"--log-level", "--log-format"} <= {opt for p in command.params for opt in p.opts}
    ]
    assert missing == []
    assert len(_commands(main)) > 15  # the walk really reached the nested groups (approvals, swarm, setup)


def test_log_level_after_the_subcommand_wins(tmp_path: Path) -> None:
    config = tmp_path / "kazma.yaml"
    config.write_text(f"store: {{path: '{tmp_path}/k.db'}}\npeople: {{ops: {{web: ops}}}}\n")
    chatty = run(["-c", str(config), "people", "invite", "ops"], cwd=tmp_path)  # makes the store, as first steps do
    assert "store.migrated" in chatty.stderr
    assert "store.migration_applied" not in chatty.stderr  # one line for a first start's dozens, each at debug
    quiet = run(["-c", str(config), "approvals", "list", "--log-level", "warning"], cwd=tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    # before and after the subcommand: the later one counts
    loud = run(["-c", str(config), "--log-level", "error", "config", "check", "--log-level", "debug"], cwd=tmp_path)
    assert loud.returncode == 0
    readable = run(["-c", str(config), "doctor", "--log-format", "console", "--model-timeout", "0.2"], cwd=tmp_path)
    assert "doctor.finished" in readable.stderr
    assert not readable.stderr.lstrip().startswith("{")


def _demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", "demo", *args],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "NO_PROXY": "127.0.0.1"},
        check=False,
    )


def test_the_demo_is_quiet_unless_asked(tmp_path: Path) -> None:
    quiet = _demo(tmp_path)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "it printed: hello, world" in quiet.stdout
    assert quiet.stderr == ""  # only problems are logged, and there were none
    chatty = _demo(tmp_path, "--log-level", "info")
    assert chatty.returncode == 0
    assert "app.started" in chatty.stderr


def _serving_config(tmp_path: Path, extra: str = "") -> Path:
    config = tmp_path / "kazma.yaml"
    config.write_text(f"store: {{path: '{tmp_path}/state/k.db'}}\nweb: {{port: 0}}\n{extra}")
    return config


def test_run_never_writes_generated_tokens_to_a_redirected_stderr(tmp_path: Path) -> None:
    config = _serving_config(tmp_path)
    log = tmp_path / "kazma.log"
    with log.open("w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "kazma.bot.cli", "-c", str(config), "run"],
            cwd=tmp_path,
            env=CLEAN_ENV,
            stdout=err,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            while "kazma is running" not in log.read_text():  # a condition, polled with a deadline
                assert process.poll() is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, "kazma run did not start"
                time.sleep(0.05)
        finally:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=30)
    text = log.read_text()
    token = (tmp_path / "state" / "web-token").read_text().strip()
    reader = (tmp_path / "state" / "web-token.reader").read_text().strip()
    assert len(token) >= 32
    assert token not in text
    assert reader not in text
    assert f"saved to {tmp_path / 'state' / 'web-token'}" in text
    assert "not printed because this output is not a terminal" in text


def test_run_shows_generated_tokens_on_a_terminal(tmp_path: Path) -> None:
    config = _serving_config(tmp_path)
    master, slave = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "kazma.bot.cli", "-c", str(config), "run"],
        cwd=tmp_path,
        env=CLEAN_ENV,
        stdout=subprocess.DEVNULL,
        stderr=slave,
        stdin=subprocess.DEVNULL,
    )
    os.close(slave)
    screen = b""
    deadline = time.monotonic() + 60
    try:
        while b"kazma is running" not in screen:
            remaining = deadline - time.monotonic()
            assert remaining > 0, screen[-2000:]
            ready, _, _ = select.select([master], [], [], remaining)
            if ready:
                screen += os.read(master, 65536)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
        os.close(master)
    token = (tmp_path / "state" / "web-token").read_text().strip()
    assert f"operator token: {token}".encode() in screen


def test_redaction_knows_token_shapes_and_registered_secrets() -> None:
    url = "POST http://127.0.0.1:9/bot123456:AAE-secret_part/getUpdates"
    assert redact(url) == "POST http://127.0.0.1:9/bot<redacted>/getUpdates"
    assert redact("token xoxb-1-2-abc and xapp-1-A1-xyz") == "token <redacted> and <redacted>"
    redact_secret("a-discord-token-with-no-shape")
    assert redact("Authorization: Bot a-discord-token-with-no-shape") == "Authorization: Bot <redacted>"
    assert redact("short") == "short"


async def test_debug_logs_of_a_live_telegram_bot_never_hold_its_token(tmp_path: Path) -> None:
    telegram = FakeTelegram()
    await telegram.start()
    try:
        config = _serving_config(
            tmp_path,
            f"platforms: {{telegram: {{token: '{telegram.token}', api_base_url: '{telegram.base_url}',"
            " chats: [-1001], home_chat: -1001, admins: [111]}}\n",
        )
        log = tmp_path / "kazma.log"
        with log.open("wb") as err:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kazma.bot.cli", "-c", str(config), "run", "--log-level", "debug",
                cwd=tmp_path, env=CLEAN_ENV, stdout=err, stderr=err, stdin=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            try:
                # the first long poll has begun: getMe and the calls before it were answered and logged
                await telegram.wait_for_call("getUpdates", answered=False, timeout=60)
            finally:
                process.send_signal(signal.SIGINT)
                await asyncio.wait_for(process.wait(), timeout=30)
    finally:
        await telegram.stop()
    text = log.read_text()
    secret = telegram.token.partition(":")[2]
    assert "/getMe" in text  # the library's request lines were logged ...
    assert "/bot<redacted>/" in text  # ... with the token cut out of their URLs
    assert secret not in text


def test_a_call_below_the_level_builds_nothing_and_the_rest_is_written_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import io
    import json
    import logging

    import structlog

    from kazma.bot.logging import configure_logging

    processed: list[str] = []
    original = structlog.stdlib.BoundLogger._process_event

    def counted(self: Any, method_name: str, event: Any, event_kw: dict[str, Any]) -> Any:
        processed.append(method_name)
        return original(self, method_name, event, event_kw)

    monkeypatch.setattr(structlog.stdlib.BoundLogger, "_process_event", counted)
    out = io.StringIO()
    configure_logging("warning", "json", out)
    log = structlog.get_logger("kazma.test_filtering")
    log.debug("test.debug", value="x")
    log.info("test.info", value="x")
    assert processed == []  # no event dict, no processor, no DropEvent for a call nobody reads
    log.warning("test.warning", value="token xoxb-123-secret")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("test.failed")
    logging.getLogger("kazma.test_filtering").setLevel(logging.DEBUG)  # a logger's own level still counts
    log.debug("test.debug_here")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(line["event"], line["level"]) for line in lines] == [
        ("test.warning", "warning"),
        ("test.failed", "error"),
        ("test.debug_here", "debug"),
    ]
    assert lines[0]["value"] == "token <redacted>"
    assert "ValueError: boom" in lines[1]["exception"]
    logging.getLogger("kazma.test_filtering").setLevel(logging.NOTSET)
