"""`kazma swarm …` carries commands out for real: against the store, with the real model provider."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kazma.bot.cli.cli_identity import system_login
from kazma.bot.store import open_store
from kazma.config import load_config_text
from kazma.engine.swarm.commands import ASK_AGAIN
from tests.fakes.openai import Completion, FakeOpenAI

if TYPE_CHECKING:
    from click.testing import Result


def kazma(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", "--log-level", "warning", "-c", str(config), "swarm", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_swarm_cli_reads_refuses_and_runs(tmp_path: Path) -> None:
    model = FakeOpenAI(models=("llama3.1",))
    await model.start()
    try:
        config = tmp_path / "kazma.yaml"
        me = system_login()  # the command line is the system user running it: ops, says people:
        config.write_text(
            f"store: {{path: '{tmp_path / 'k.db'}'}}\n"
            f"model: {{base_url: '{model.base_url}', max_retries: 0}}\n"
            f"people: {{ops: {{cli: '{me}'}}}}\n"
            "approvals: {approvers: []}\n"
        )
        # Before any store: reading the swarm refuses the path (it answered from an empty store made on the spot)
        missing = await asyncio.to_thread(kazma, config, "status")
        assert missing.returncode == 2, missing.stdout + missing.stderr
        assert f"no Kazma store at {tmp_path / 'k.db'}: kazma run creates it" in missing.stderr
        assert not (tmp_path / "k.db").exists()

        refused = await asyncio.to_thread(kazma, config, "dispatch", "builder", "make", "it")
        assert refused.stdout.startswith("/swarm dispatch starts, changes or steers work")
        status = await asyncio.to_thread(kazma, config, "status")  # work a command starts may make the store
        assert status.returncode == 0, status.stderr
        assert status.stdout.strip() == "swarm: 0 running, 0 paused, 4 workers"
        claimed = await asyncio.to_thread(kazma, config, "--as", "mallory", "dispatch", "builder", "make", "it")
        assert claimed.returncode == 2
        assert "--as mallory would be someone else" in claimed.stderr

        config.write_text(config.read_text().replace("approvers: []", "approvers: [ops]"))
        model.script(Completion(content="built it"))
        ran = await asyncio.to_thread(kazma, config, "--as", "ops", "dispatch", "builder", "make", "it")
        assert ran.returncode == 0, ran.stdout + ran.stderr
        lines = ran.stdout.strip().splitlines()
        assert lines[0].startswith("swarm task ")
        assert lines[-2:] == ["succeeded: built it", "tools: did not run: no tool that changes anything was started"]
        history = await asyncio.to_thread(kazma, config, "history")
        assert "succeeded" in history.stdout
        assert "dispatch" in history.stdout
        metrics = await asyncio.to_thread(kazma, config, "metrics")
        assert metrics.returncode == 0, metrics.stderr
        assert "builder: 1 completed, 0 failed" in metrics.stdout
        parsed = await asyncio.to_thread(
            kazma, config, "--parse-only", "fanout", "--strategy", "vote", "--deadline", "60", "builder,refiner", "go"
        )
        assert '"strategy": "vote"' in parsed.stdout
        assert '"deadline": 60' in parsed.stdout
        unknown = await asyncio.to_thread(kazma, config, "--as", "ops", "dispatch", "--expect", "nope", "builder", "x")
        assert unknown.returncode == 1
        assert unknown.stdout.startswith("Not started: unknown output schema 'nope'")
    finally:
        await model.stop()


async def made_store(path: Path) -> None:
    """The store as `kazma run` makes it at its first start: the terminal reads and steers only an existing one."""
    loaded = load_config_text(f"store: {{path: '{path}'}}\n", environ={})
    await (await open_store(loaded.config)).close()


@asynccontextmanager
async def operated(tmp_path: Path) -> AsyncIterator[tuple[FakeOpenAI, Path]]:
    """A model server and a kazma.yaml whose operator (ops) is the system user running the tests."""
    model = FakeOpenAI(models=("llama3.1",))
    await model.start()
    try:
        config = tmp_path / "kazma.yaml"
        config.write_text(
            f"store: {{path: '{tmp_path / 'k.db'}'}}\n"
            f"model: {{base_url: '{model.base_url}', max_retries: 0}}\n"
            f"people: {{ops: {{cli: '{system_login()}'}}}}\n"
            "approvals: {approvers: [ops]}\n"
        )
        await made_store(tmp_path / "k.db")
        yield model, config
    finally:
        await model.stop()


async def test_a_retry_from_the_terminal_runs_the_new_task_and_a_risky_one_is_confirmed_in_the_same_process(
    tmp_path: Path,
) -> None:
    # The CLI waited only for answers saying "started": a retry ("retried as <id>") exited at once and its stop
    # cancelled the new task; and a retry that must be asked twice could never be, a new process for each send.
    async with operated(tmp_path) as (model, config):
        model.script(Completion(content="built it"))
        ran = await asyncio.to_thread(kazma, config, "--as", "ops", "dispatch", "builder", "make", "it")
        assert ran.returncode == 0, ran.stdout + ran.stderr
        first = ran.stdout.split()[2]

        model.script(Completion(content="built it again"))
        again = await asyncio.to_thread(kazma, config, "--as", "ops", "retry", first)
        assert again.returncode == 0, again.stdout + again.stderr
        lines = again.stdout.strip().splitlines()
        assert lines[0].startswith(f"swarm task {first} retried as ")
        second = lines[0].split()[-1]
        assert "succeeded: built it again" in lines, again.stdout
        status = await asyncio.to_thread(kazma, config, "status", second)
        assert "succeeded" in status.stdout, status.stdout

        # Its outcome unknown (the process running it died): asked twice; --yes is the second ask.
        with sqlite3.connect(tmp_path / "k.db") as db:
            db.execute("UPDATE swarm_tasks SET status = 'interrupted' WHERE id = ?", (second,))
        asked = await asyncio.to_thread(kazma, config, "--as", "ops", "retry", second)
        assert asked.returncode == 1, asked.stdout + asked.stderr
        assert ASK_AGAIN in asked.stdout
        assert "run it again with --yes" in asked.stderr
        model.script(Completion(content="built it a third time"))
        confirmed = await asyncio.to_thread(kazma, config, "--as", "ops", "retry", "--yes", second)
        assert confirmed.returncode == 0, confirmed.stdout + confirmed.stderr
        assert f"swarm task {second} retried as " in confirmed.stdout
        assert "succeeded: built it a third time" in confirmed.stdout.splitlines()


async def test_the_terminal_shows_and_resets_the_breakers_kazma_saved(tmp_path: Path) -> None:
    # The terminal never read the saved breakers: `workers` said "closed" for one saved open, and a reset said
    # "it was closed" while saving closed over it.
    async with operated(tmp_path) as (_model, config):
        first = await asyncio.to_thread(kazma, config, "workers")
        assert first.returncode == 0, first.stderr
        with sqlite3.connect(tmp_path / "k.db") as db:  # what a kazma run whose builder kept failing saved
            db.execute(
                "INSERT INTO swarm_breakers (worker, state, failures, retry_at, updated_at) VALUES (?, ?, ?, ?, ?)",
                ("builder", "open", 5, time.time() + 600, time.time()),
            )
        shown = await asyncio.to_thread(kazma, config, "workers")
        assert "builder: breaker open" in shown.stdout, shown.stdout
        reset = await asyncio.to_thread(kazma, config, "--as", "ops", "breaker", "reset", "builder")
        assert reset.returncode == 0, reset.stderr
        assert "builder's breaker is closed (it was open)" in reset.stdout, reset.stdout
        assert "a running `kazma run` keeps its own breaker" in reset.stderr
        again = await asyncio.to_thread(kazma, config, "workers")
        assert "builder: breaker closed" in again.stdout, again.stdout


def test_a_refused_or_unknown_task_command_ends_non_zero(tmp_path: Path) -> None:
    # The answer is chat's sentence on stdout; a script (or cron) only sees the exit code, which was 0 for a
    # refused cancel and for a cancel, retry, approve, reject or status of a task id that does not exist.
    from click.testing import CliRunner

    from kazma.bot.cli.context import Context
    from kazma.bot.cli.swarm_cli import swarm

    path = tmp_path / "kazma.yaml"
    path.write_text(
        f"store: {{path: '{tmp_path / 'k.db'}'}}\napprovals: {{approvers: ['cli:ops'], cli_identity: declared}}\n"
    )

    asyncio.run(made_store(tmp_path / "k.db"))

    def invoke(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(swarm, list(args), obj=Context(path))
        assert result.exception is None or isinstance(result.exception, SystemExit), result.output
        return result.exit_code, result.stdout.strip().splitlines()[-1]

    code, said = invoke("--as", "mallory", "cancel", "t-0001")
    assert code == 1
    assert said.startswith("/swarm cancel starts, changes or steers work, so it needs an approver")
    for verb in ("cancel", "retry", "approve", "reject", "status"):
        assert invoke("--as", "ops", verb, "t-0001") == (1, "no swarm task 't-0001'"), verb
    assert invoke("--as", "ops", "status") == (0, "swarm: 0 running, 0 paused, 4 workers")
    assert invoke("--as", "mallory", "history") == (0, "no swarm tasks yet")


def _parse_only(tmp_path: Path, *words: str) -> Result:
    """`kazma swarm --parse-only WORDS…` on a configuration of defaults, as a terminal hands the words over."""
    from click.testing import CliRunner

    from kazma.bot.cli import main

    config = tmp_path / "kazma.yaml"
    config.write_text(f"store: {{path: '{tmp_path / 'k.db'}'}}\n")
    return CliRunner().invoke(main, ["-c", str(config), "swarm", "--parse-only", *words])


def _chat_reads(line: str) -> dict[str, Any]:
    """``line`` as chat's /swarm grammar reads it under the default configuration (GrammarError when refused)."""
    from kazma.engine.swarm.grammar import parse

    defaults = load_config_text("", environ={}).config
    read: dict[str, Any] = json.loads(json.dumps(parse(line, workers=defaults.agents.workers,
                                                        pipelines=defaults.pipelines).to_json()))  # fmt: skip
    return read


def test_an_arrow_reads_as_it_does_in_chat(tmp_path: Path) -> None:
    # The README's own example, `/swarm fanout researcher,builder compare X and Y -> slack:C0123ABCD`, typed as
    # `kazma swarm …` ended in click's "No such option '->'": the arrow starts with "-". So did task text with an
    # arrow in it. The terminal must read each line exactly as chat's grammar does.
    for line in [
        "fanout researcher,builder compare X and Y -> slack:C0123ABCD",
        "dispatch researcher map a -> b then c",
        "dispatch researcher map a -> b -> discord:123",
        "status -> telegram:-100123",
        "list -> slack:C0123ABCD",
    ]:
        chat = _chat_reads(line)
        verb, *words = line.split()
        # with "--" (how a task word that starts with "-" is typed) the words after it are the task's
        typed = [[verb, *words]]
        if verb in ("fanout", "dispatch"):
            typed.append([verb, words[0], "--", *words[1:]])
        for argv in typed:
            result = _parse_only(tmp_path, *argv)
            assert result.exit_code == 0, (argv, result.output)
            assert json.loads(result.stdout) == chat, argv
    bare = _parse_only(tmp_path, "dispatch", "researcher", "go", "->")
    assert bare.exit_code == 2
    assert bare.stderr.startswith("a route needs <platform>:<chat> after '->'")


def test_two_routes_are_refused_not_one_dropped(tmp_path: Path) -> None:
    # `… --to discord:123 -> slack:C0123ABCD` became two --to and click kept the last unsaid; with the arrow after
    # the --to's task words (`… -> slack:C0123ABCD --to discord:123`), the typed route became task text unsaid.
    for words in [
        "go --to discord:123 -> slack:C0123ABCD",
        "go -> slack:C0123ABCD --to discord:123",
        "go --to discord:123 --to slack:C0123ABCD",
        "--to=discord:123 -- go -> slack:C0123ABCD",
    ]:
        result = _parse_only(tmp_path, "dispatch", "researcher", *words.split())
        assert result.exit_code == 2, (words, result.output)
        assert "more than one route" in result.stderr, (words, result.stderr)
    # after "--" a --to is task words, and the arrow's route is the one route, as chat reads it
    result = _parse_only(tmp_path, "dispatch", "researcher", "--", "go", "--to", "x", "->", "slack:C0123ABCD")
    assert result.exit_code == 0, result.output
    assert '"prompt": "go --to x", "route": {"platform": "slack", "chat": "C0123ABCD"}' in result.stdout


def test_a_word_that_begins_with_an_arrow_reads_as_it_does_in_chat(tmp_path: Path) -> None:
    # `kazma swarm dispatch researcher go ->slack:C1` (no space after the arrow) ended in click's "No such option
    # '->'", as did `-->x`: words that begin with dashes and '>', which chat's grammar reads as task text.
    from kazma.engine.swarm.syntax import GrammarError

    for line in [
        "dispatch researcher go ->slack:C1",
        "dispatch researcher go a->",
        "dispatch researcher go ->",
        "dispatch researcher go -->x",
        "dispatch researcher ->x go",
        "fanout researcher,builder -->x ->y -> slack:C0123ABCD",
    ]:
        result = _parse_only(tmp_path, *line.split())
        refused: str | None = None
        try:
            chat = _chat_reads(line)
        except GrammarError as exc:
            refused = exc.message
        if refused is not None:
            assert (result.exit_code, result.stderr) == (2, refused + "\n"), line
            continue
        assert result.exit_code == 0, (line, result.output)
        assert json.loads(result.stdout) == chat, line
