from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from click.testing import CliRunner

from kazma.bot.cli import main
from kazma.config import __version__

REPO = Path(__file__).resolve().parent.parent
CLEAN_ENV = {
    k: v for k, v in os.environ.items() if not k.endswith(("_TOKEN", "_SECRET")) and not k.startswith("KAZMA_")
}


def run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", *args],
        cwd=cwd,
        env={**CLEAN_ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"kazma, version {__version__}"


def test_config_check_committed_default_reports_every_platform_off(tmp_path: Path) -> None:
    result = run(["config", "check", str(REPO / "kazma.yaml")], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith("kazma.yaml: valid")
    assert "telegram  off  token is empty (set TELEGRAM_BOT_TOKEN)" in result.stdout
    assert "slack     off  bot_token is empty (set SLACK_BOT_TOKEN)" in result.stdout
    assert "discord   off  token is empty (set DISCORD_BOT_TOKEN)" in result.stdout
    assert "web console alone" in result.stdout


def test_config_check_with_a_token_reports_platform_on_and_warnings(tmp_path: Path) -> None:
    result = run(["config", "check", str(REPO / "kazma.yaml")], cwd=tmp_path, env={"DISCORD_BOT_TOKEN": "x"})
    assert result.returncode == 0, result.stderr
    assert "discord   on   gateway" in result.stdout
    assert "no approvers for discord" in result.stdout
    assert "home_channel is not set" in result.stdout


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("platforms: {telegram: {home_chat: general}}", "platforms.telegram.home_chat: expected an integer chat id"),
        ("approvals: {deadline_seconds: -1}", "approvals.deadline_seconds: must be greater than 0, got -1"),
        ("tools: {shell: yes-please}", "tools.shell: expected one of read, write, dangerous"),
        ("web: [1, 2", "invalid YAML"),
    ],
)
def test_config_check_malformed_exits_2_with_one_line(tmp_path: Path, text: str, line: str) -> None:
    path = tmp_path / "kazma.yaml"
    path.write_text(text)
    result = run(["config", "check", str(path)], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    problems = result.stderr.strip().splitlines()
    assert len(problems) == 1
    assert problems[0].startswith(f"{path}: ")
    assert line in problems[0]


def test_config_flag_and_env_variable_pick_the_file(tmp_path: Path) -> None:
    path = tmp_path / "other.yaml"
    path.write_text("web: {port: 9999}\n")
    assert run(["-c", str(path), "config", "check"], cwd=tmp_path).returncode == 0
    assert run(["config", "check"], cwd=tmp_path, env={"KAZMA_CONFIG": str(path)}).returncode == 0
    missing = run(["config", "check"], cwd=tmp_path)
    assert missing.returncode == 2
    assert "kazma.yaml: file not found" in missing.stderr


class _Models(BaseHTTPRequestHandler):
    status = 200
    answer: ClassVar[object] = {"object": "list", "data": [{"id": "llama3.1"}]}

    def do_GET(self) -> None:
        body = json.dumps(self.answer).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


class _Rejecting(_Models):
    status = 401


@pytest.fixture
def model_server(request: pytest.FixtureRequest) -> Iterator[str]:
    handler = getattr(request, "param", _Models)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_doctor_all_good(tmp_path: Path, model_server: str) -> None:
    config = tmp_path / "kazma.yaml"
    config.write_text(
        f"store: {{path: {tmp_path}/db/kazma.db}}\nmodel: {{base_url: '{model_server}'}}\n"
        "people: {alice: {web: alice}}\napprovals: {approvers: ['web:alice']}\n"
    )
    # The store as the first steps make it, before doctor: doctor only reads a store, it never makes one.
    invited = run(["-c", str(config), "people", "invite", "alice"], cwd=tmp_path)
    assert invited.returncode == 0, invited.stderr
    result = run(["-c", str(config), "doctor"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK    store" in result.stdout
    assert "OK    model" in result.stdout
    assert result.stdout.strip().endswith("0 failed, 0 warnings")
    assert (tmp_path / "db" / "kazma.db").exists()


@pytest.mark.parametrize("model_server", [_Rejecting], indirect=True)
def test_doctor_names_a_rejected_key(tmp_path: Path, model_server: str) -> None:
    config = tmp_path / "kazma.yaml"
    config.write_text(f"store: {{path: {tmp_path}/kazma.db}}\nmodel: {{base_url: '{model_server}'}}\n")
    result = run(["-c", str(config), "doctor"], cwd=tmp_path)
    assert result.returncode == 1
    assert "the server rejected the API key (HTTP 401)" in result.stdout


def test_doctor_unreachable_model_and_unwritable_store(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    config = tmp_path / "kazma.yaml"
    # port 9 on loopback: nothing listens there
    config.write_text(f"store: {{path: {blocker}/kazma.db}}\nmodel: {{base_url: 'http://127.0.0.1:9/v1'}}\n")
    result = run(["-c", str(config), "doctor", "--model-timeout", "2"], cwd=tmp_path)
    assert result.returncode == 1
    assert "FAIL  store" in result.stdout
    assert "FAIL  model" in result.stdout
    assert "unreachable" in result.stdout
    assert result.stdout.strip().endswith("2 failed, 1 warning")  # and nobody can decide in the console


def test_doctor_warns_when_a_platform_has_no_approvers(tmp_path: Path, model_server: str) -> None:
    config = tmp_path / "kazma.yaml"
    config.write_text(
        f"store: {{path: {tmp_path}/kazma.db}}\nmodel: {{base_url: '{model_server}'}}\n"
        # port 9 on loopback: doctor asks Discord there (and finds nobody), never on the internet
        "platforms: {discord: {token: abc, home_channel: 1, api_base_url: 'http://127.0.0.1:9/api/v10'}}\n"
    )
    result = run(["-c", str(config), "doctor"], cwd=tmp_path)
    assert result.returncode == 1
    assert "WARN  platform.discord  no approvers for discord" in result.stdout
    assert "FAIL  platform.discord  unreachable (ConnectError" in result.stdout


def test_json_logs_when_not_a_terminal_and_console_on_request(tmp_path: Path) -> None:
    config = tmp_path / "kazma.yaml"
    config.write_text(f"store: {{path: {tmp_path}/kazma.db}}\nmodel: {{base_url: 'http://127.0.0.1:9/v1'}}\n")
    result = run(["-c", str(config), "doctor", "--model-timeout", "1"], cwd=tmp_path)
    events = [json.loads(line) for line in result.stderr.splitlines()]
    finished = [e for e in events if e["event"] == "doctor.finished"]
    assert len(finished) == 1
    assert finished[0]["failed"] == 1
    assert finished[0]["level"] == "info"
    assert "timestamp" in finished[0]
    quiet = run(["-c", str(config), "--log-level", "warning", "doctor", "--model-timeout", "1"], cwd=tmp_path)
    assert "doctor.finished" not in quiet.stderr
    console = run(["-c", str(config), "--log-format", "console", "doctor", "--model-timeout", "1"], cwd=tmp_path)
    assert "doctor.finished" in console.stderr
    assert not console.stderr.lstrip().startswith("{")


@pytest.mark.parametrize(
    ("store", "said"),
    [
        ("folder", "it is a folder"),
        ("file/k.db", "{tmp}/file is a file, not a folder"),
    ],
)
@pytest.mark.parametrize("command", [["approvals", "list"], ["people", "list"], ["swarm", "status"]])
@pytest.mark.parametrize("named_by", ["-c", "KAZMA_CONFIG"])
def test_a_store_path_that_cannot_be_opened_is_one_line_not_a_traceback(
    tmp_path: Path, store: str, said: str, command: list[str], named_by: str
) -> None:
    """The line names the file the configuration was read from: it said "kazma.yaml:" whatever file that was."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "garbage.db").write_text("not SQLite")
    config = tmp_path / "other.yaml"
    config.write_text(f"store: {{path: {store}}}\n")
    if named_by == "-c":
        result = CliRunner().invoke(main, ["-c", str(config), *command])
    else:
        result = CliRunner().invoke(main, command, env={"KAZMA_CONFIG": str(config)})
    assert isinstance(result.exception, SystemExit), result.exception  # was sqlite3.OperationalError, FileExistsError
    assert result.exit_code == 2
    where = tmp_path / store
    assert result.stderr.splitlines()[-1] == (
        f"{config}: store.path: cannot open the SQLite store {where}: {said.format(tmp=tmp_path)}"
    )


@pytest.mark.parametrize("text", ["web:\n  prot: 9000\n", None])
def test_doctor_on_a_file_it_cannot_load_is_a_failed_check_in_its_own_shape(
    tmp_path: Path, text: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The README: doctor says one line per problem, exits 1 if a check fails, and --json is one object on stdout.
    # A file with a typo (or none at all) ended it with exit 2 and the line on stderr: a script reading --json got
    # no JSON at all, only when the configuration was what it most needed to hear about.
    monkeypatch.chdir(tmp_path)
    if text is not None:
        (tmp_path / "kazma.yaml").write_text(text)
    said = "kazma.yaml: web.prot: unknown key" if text is not None else "kazma.yaml: file not found"
    as_json = CliRunner().invoke(main, ["doctor", "--json"])
    assert as_json.exit_code == 1, as_json.output
    report = json.loads(as_json.stdout)
    assert report["failed"] == 1
    assert report["warnings"] == 0
    [check] = report["checks"]
    assert check["name"] == "config"
    assert check["level"] == "fail"
    assert check["detail"].startswith(said)
    plain = CliRunner().invoke(main, ["doctor"])
    assert plain.exit_code == 1
    assert plain.stdout.splitlines()[0].startswith(f"FAIL  config            {said}")
    assert plain.stdout.splitlines()[-1] == "1 failed, 0 warnings"


class _Missing(_Models):
    status = 404


class _Loading(_Models):
    status = 503


class _AList(_Models):
    answer: ClassVar[object] = [{"id": "llama3.1"}]


class _NoData(_Models):
    answer: ClassVar[object] = {"object": "list", "data": None}


@pytest.mark.parametrize(
    ("model_server", "name", "said"),
    [
        (_Models, "gpt-x", "reachable, but model 'gpt-x' is not listed (llama3.1): set models.backup.name to one"),
        (_Rejecting, "llama3.1", "the server rejected the API key (HTTP 401): check models.backup.api_key"),
        (_Missing, "llama3.1", "HTTP 404: is models.backup.base_url the API's base (usually ending in /v1)?"),
        # a server error is the server's (a model still loading), not a wrong base_url; a JSON answer that is no
        # model list ended doctor in AttributeError / TypeError, a traceback instead of the checklist
        (_Loading, "llama3.1", "HTTP 503: the model server failed to answer: see its log, then run doctor again"),
        (_AList, "llama3.1", "answered, but not with a model list: is models.backup.base_url an OpenAI-compatible"),
        (_NoData, "llama3.1", "answered, but not with a model list: is models.backup.base_url an OpenAI-compatible"),
    ],
    indirect=["model_server"],
)
async def test_each_model_problem_names_the_setting_that_fixes_it(model_server: str, name: str, said: str) -> None:
    # The README: doctor says one line per problem with its fix. A first run without a model server read
    # "unreachable (ConnectError: All connection attempts failed)" and no word of what to change.
    from kazma.bot.cli.doctor import check_endpoint
    from kazma.config.models import ModelConfig

    check = await check_endpoint(
        ModelConfig(base_url=model_server, name=name), "model.backup", wait_seconds=5, key="models.backup"
    )
    assert said in check.detail
    # port 9 on loopback: nothing listens there
    closed = await check_endpoint(ModelConfig(base_url="http://127.0.0.1:9/v1"), "model", wait_seconds=5)
    assert closed.detail.startswith("http://127.0.0.1:9/v1/models: unreachable (ConnectError")
    assert closed.detail.endswith(
        ": start the model server there, or set model.base_url to an OpenAI-compatible one that runs"
    )
