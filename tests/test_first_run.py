"""From `pip install` to the first decided press, the way a new team goes, on a fresh machine.

A wheel is built from exactly what the Dockerfile's build stage copies and installed into a fresh
virtual environment (its dependencies resolved by pip, nothing from this checkout on the path).
Then, with that environment's `kazma` only: `kazma init` with flags, `kazma doctor` against the
three wire-level platform fakes and a fake model server, `kazma run`, and a press in the console
that is decided — the operator `init` wrote is an approver there. The same installation runs the
image's entrypoint (`kazma demo --terminal`) and its health check against the running Kazma.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import aiohttp
import pytest

from kazma.config import load_config
from kazma.config.keyring import DECISION_KEYS, read_keyring
from kazma.engine.scenario import agent_prompts
from tests.deploy_support import build_context, stages
from tests.fakes.discord import ALICE_ID, HOME_CHANNEL_ID
from tests.fakes.openai import Completion, FakeOpenAI, FakeToolCall
from tests.fakes.slack import FAKE_APP_TOKEN, FAKE_BOT_TOKEN
from tests.passkey_support import SoftAuthenticator, enrol
from tests.platforms_support import SLACK_ADMIN, SLACK_CHANNEL, TG_ADMIN, TG_CHAT, Fakes, three_fakes

pytestmark = pytest.mark.slow

TEMPLATES = ("kazma.yaml.in", "telegram.yaml.in", "slack.yaml.in", "discord.yaml.in")


@pytest.fixture
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fresh-machine")
    context = build_context(root / "context")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(root / "wheels"), "."],
        cwd=context,
        check=True,
        timeout=600,
    )
    (wheel,) = (root / "wheels").glob("kazma-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for template in TEMPLATES:
        assert f"kazma/bot/templates/{template}" in names  # kazma init works from a wheel
    assert any(name.endswith(".dist-info/licenses/LICENSE") or name.endswith("/LICENSE") for name in names)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet", str(wheel)],
        check=True,
        timeout=900,
    )
    # what runs from here is the installed wheel, not this checkout
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import kazma.bot; print(kazma.bot.__file__)"],
        cwd=root,
        env=clean_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.strip().startswith(str(venv))
    return venv


def clean_env(**extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")}
    return {**keep, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", **extra}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _entrypoint_plays_the_demo(venv: Path, cwd: Path) -> None:
    """`docker run kazma demo --terminal`, without Docker: the image's ENTRYPOINT with those arguments."""
    (entrypoint,) = [i.exec_form() for i in stages()[-1] if i.keyword == "ENTRYPOINT"]
    assert entrypoint is not None
    result = subprocess.run(
        [str(venv / "bin" / entrypoint[0]), *entrypoint[1:], "demo", "--terminal"],
        cwd=cwd,
        env=clean_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "it printed: hello, world" in result.stdout
    assert result.stderr == ""


async def _wait_for(predicate: object, *, timeout: float, what: str) -> None:
    assert callable(predicate)
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)  # a condition, polled with a deadline
    assert predicate(), what


def _point_at_fakes(text: str, fakes: Fakes, port: int) -> str:
    """The one edit a test makes: the platforms' API addresses are the fakes' (a team keeps the defaults)."""
    replaced = (
        text.replace("https://api.telegram.org", fakes.telegram.base_url)
        .replace("https://slack.com/api/", fakes.slack.api_url)
        .replace("https://discord.com/api/v10", fakes.discord.api_base)
        .replace('gateway_url: ""', f"gateway_url: '{fakes.discord.gateway_url}'")
        .replace("port: 8765", f"port: {port}")
    )
    assert replaced.count("127.0.0.1:") >= 4
    return replaced


async def test_wheel_init_doctor_run_and_the_first_press_in_the_console_is_decided(
    fresh_venv: Path, tmp_path: Path
) -> None:
    kazma = str(fresh_venv / "bin" / "kazma")
    team = tmp_path / "team"
    team.mkdir()
    _entrypoint_plays_the_demo(fresh_venv, tmp_path)  # one wheel, one install: the image's command first
    async with three_fakes() as fakes, FakeOpenAI(models=("fake-model",)) as model:
        init = subprocess.run(
            [
                kazma, "init", "--no-input", "--web-login", "alice", "--public-url", "https://kazma.example.org",
                "--platform", "telegram", "--telegram-user", str(TG_ADMIN), "--telegram-chat", str(TG_CHAT),
                "--platform", "slack", "--slack-user", SLACK_ADMIN, "--slack-channel", SLACK_CHANNEL,
                "--platform", "discord", "--discord-user", str(ALICE_ID), "--discord-channel", str(HOME_CHANNEL_ID),
            ],
            cwd=team, env=clean_env(), capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert init.returncode == 0, init.stderr
        assert "export TELEGRAM_BOT_TOKEN=… SLACK_BOT_TOKEN=… DISCORD_BOT_TOKEN=… SLACK_APP_TOKEN=…" in init.stdout
        config = team / "kazma.yaml"
        port = free_port()
        config.write_text(_point_at_fakes(config.read_text(), fakes, port))
        env = clean_env(
            TELEGRAM_BOT_TOKEN=fakes.telegram.token,
            SLACK_BOT_TOKEN=FAKE_BOT_TOKEN,
            SLACK_APP_TOKEN=FAKE_APP_TOKEN,
            DISCORD_BOT_TOKEN=fakes.discord.token,
            KAZMA_MODEL_BASE_URL=model.base_url,
            KAZMA_MODEL="fake-model",
        )

        doctor = await asyncio.create_subprocess_exec(
            kazma, "doctor", cwd=team, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(doctor.communicate(), timeout=120)
        report = out.decode()
        assert doctor.returncode == 0, report + err.decode()[-2000:]
        assert "0 failed" in report.splitlines()[-1]
        for platform in ("telegram", "slack", "discord"):
            assert re.search(rf"OK    platform\.{platform} +token accepted", report), report
        assert "FAIL" not in report
        assert "web approvers" not in report  # init made the operator one

        loaded = load_config(config, environ=env)
        builder = agent_prompts(loaded.config)["builder"]
        model.script_agent(
            builder,
            Completion(tool_calls=(FakeToolCall("shell", json.dumps({"command": "echo first press"})),)),
            Completion(content="It printed: first press"),
        )

        log = tmp_path / "kazma.log"
        with log.open("wb") as sink:
            running = await asyncio.create_subprocess_exec(
                kazma, "run", cwd=team, env=env, stdout=sink, stderr=sink, stdin=asyncio.subprocess.DEVNULL
            )
        try:
            await _wait_for(lambda: "kazma is running" in log.read_text(), timeout=90, what="kazma run started")
            await _wait_for(lambda: fakes.discord.identified and fakes.slack.socket_connected, timeout=60, what="up")

            # the console's tokens: generated at first start, in their 0600 files, never in the log
            state = team / ".kazma"
            token = (state / "web-token").read_text().strip()
            assert stat.S_IMODE(state.stat().st_mode) == 0o700
            for private in (state / "web-token", state / "web-token.reader", state / "kazma.db"):
                assert stat.S_IMODE(private.stat().st_mode) == 0o600, private
            assert token not in log.read_text()
            # the decision key: made at first start beside the store's folder (never in it), 0600, never logged
            keys = team / ".kazma-keys"
            assert stat.S_IMODE(keys.stat().st_mode) == 0o700
            assert stat.S_IMODE((keys / "decision").stat().st_mode) == 0o600
            [written] = read_keyring(DECISION_KEYS, keys, environ={}).written()
            assert written not in log.read_text()
            assert f"decision key made at {keys / 'decision'}" in log.read_text()

            url = f"http://127.0.0.1:{port}"
            # cookies are Secure (public_url is https://, as behind a TLS proxy): this client is that proxy
            jar = aiohttp.CookieJar(unsafe=True, treat_as_secure_origin=[url])
            async with aiohttp.ClientSession(cookie_jar=jar) as http:
                # The first account: nobody holds a passkey yet, so the operator token (read only) may make one
                # enrolment link, for alice, whom init made the approver; her passkey then signs her in.
                page = await (await http.get(f"{url}/login")).text()
                login_csrf = re.search(r'name="csrf" value="([^"]+)"', page)
                assert login_csrf is not None
                await http.post(f"{url}/login", data={"name": "alice", "token": token, "csrf": login_csrf.group(1)})
                console = await (await http.get(f"{url}/")).text()
                assert "Enrol the first account" in console, console[:2000]
                reading = re.search(r'name="kazma-csrf" content="([^"]+)"', console)
                assert reading is not None
                moved = await http.post(
                    f"{url}/people/bootstrap", data={"csrf": reading.group(1), "person": "alice"},
                    allow_redirects=False,
                )  # fmt: skip
                assert moved.status == 303, await moved.text()
                # the browser is on the public https:// origin, behind the proxy this client stands in for
                await enrol(
                    http, url, moved.headers["Location"], SoftAuthenticator(), origin="https://kazma.example.org"
                )
                console = await (await http.get(f"{url}/")).text()
                assert "alice (web:alice, passkey) · operator" in console
                csrf = re.search(r'name="kazma-csrf" content="([^"]+)"', console)
                assert csrf is not None, console[:500]
                await http.post(f"{url}/console/send", data={"text": "@builder run it once", "csrf": csrf.group(1)})
                async with asyncio.timeout(60):
                    while "/decide" not in (console := await (await http.get(f"{url}/")).text()):
                        await asyncio.sleep(0.1)
                request = re.search(r"/approvals/([A-Za-z0-9_-]+)/decide", console)
                assert request is not None
                decided = await http.post(
                    f"{url}/approvals/{request.group(1)}/decide",
                    data={"decision": "approve", "csrf": csrf.group(1), "next": "/"},
                )
                after = await decided.text()
                assert "Approved. Recorded as alice (web:alice)." in after, after[:2000]
                assert "not an approver" not in after
                # every card shows the one outcome, the Telegram one included
                await _wait_for(
                    lambda: any(
                        "APPROVED by alice (web:alice)" in m.text and not m.buttons
                        for m in fakes.telegram.bot_messages(TG_CHAT)
                    ),
                    timeout=30,
                    what="the Telegram card settled",
                )

                # the approval was sealed by the press and verified before the command ran
                def started() -> bool:
                    with sqlite3.connect(state / "kazma.db") as db:
                        rows = db.execute(
                            "SELECT event FROM approval_events WHERE request_id = ? AND event LIKE 'execution_%'",
                            (request.group(1),),
                        ).fetchall()
                    db.close()
                    return bool(rows)

                await _wait_for(started, timeout=30, what="the approved command's execution recorded")
                with sqlite3.connect(state / "kazma.db") as db:
                    events = [r[0] for r in db.execute(
                        "SELECT event FROM approval_events WHERE request_id = ? ORDER BY seq", (request.group(1),)
                    )]  # fmt: skip
                db.close()
                assert "execution_started" in events, events
                assert "execution_refused" not in events, events
                health = await http.get(f"{url}/healthz")
                said = (await health.text()).splitlines()
                assert (health.status, said[0]) == (200, "ok")
                assert sorted(said[1:]) == [f"platform {p}: serving" for p in ("discord", "slack", "telegram")]

            # the image's HEALTHCHECK command, run by the fresh install against this Kazma
            (check,) = [i.args for i in stages()[-1] if i.keyword == "HEALTHCHECK"]
            command = json.loads(check[check.index("CMD") + 3 :].strip())
            healthy = subprocess.run(
                [str(fresh_venv / "bin" / command[0]), *command[1:]],
                env=clean_env(KAZMA_HEALTHZ=f"{url}/healthz"),
                timeout=30,
                check=False,
            )
            assert healthy.returncode == 0
        finally:
            running.send_signal(signal.SIGINT)
            await asyncio.wait_for(running.wait(), timeout=60)
        assert running.returncode == 0, log.read_text()[-3000:]
