"""``store.url``: a SQLite path or a PostgreSQL URL, anything else refused; every command on either backend,
and a PostgreSQL it cannot use said in one line."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from kazma.bot.store import open_pg_store
from kazma.config import load_config, load_config_text
from kazma.config.errors import ConfigError


def test_sqlite_url_is_the_store_path() -> None:
    relative = load_config_text("store: {url: 'sqlite:///state/k.db'}").config.store
    absolute = load_config_text("store: {url: 'sqlite:////var/lib/kazma/k.db'}").config.store
    assert (relative.backend, relative.path, relative.postgres_url) == ("sqlite", Path("state/k.db"), None)
    assert absolute.path == Path("/var/lib/kazma/k.db")
    default = load_config_text("").config.store
    assert (default.backend, default.path) == ("sqlite", Path(".kazma/kazma.db"))


def test_postgresql_url_takes_its_password_from_the_environment() -> None:
    store = load_config_text(
        "store: {url: 'postgresql://kazma:${KAZMA_PG_PASSWORD}@db.internal:5432/kazma'}",
        environ={"KAZMA_PG_PASSWORD": "s3cret"},
    ).config.store
    assert store.backend == "postgresql"
    assert store.postgres_url == "postgresql://kazma:s3cret@db.internal:5432/kazma"
    assert store.secret == "s3cret"
    assert load_config_text("store: {url: 'postgres://db/kazma'}").config.store.secret == ""


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        ("store: {url: 'mysql://u:hunter2@h/db'}", "store.url: expected sqlite:///path or postgresql://…, got a mysql"),
        ("store: {url: 'k.db'}", "store.url: expected sqlite:///path or postgresql://…, got no scheme"),
        ("store: {url: 'sqlite:///a.db', path: b.db}", "store.url: give store.path or a sqlite:/// store.url"),
        ("store: {url: 'postgresql://h/db', path: b.db}", "store.path: store.path is the SQLite file"),
        ("store: {url: 'sqlite://'}", "store.url: a SQLite store.url is sqlite:///relative/path"),
    ],
)
def test_other_urls_are_config_errors(yaml: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config_text(yaml)
    assert message in str(caught.value)
    assert "hunter2" not in str(caught.value)  # a URL's password never reaches the message


def _kazma(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    # In a process of its own: the CLI configures logging for the whole process.
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KAZMA_")}
    return subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", "-c", "kazma.yaml", *args],
        cwd=tmp_path,  # the default store.path is relative: nothing may appear here
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


UNREACHABLE = (
    "store: {url: 'postgresql://kazma:${KAZMA_PG_PASSWORD}@127.0.0.1:1/kazma'}\napprovals: {approvers: ['cli:alice']}\n"
)
TOKENS = {"KAZMA_WEB_TOKEN": "o" * 40, "KAZMA_WEB_READER_TOKEN": "r" * 40}


def test_kazma_run_on_a_postgresql_it_cannot_reach_says_so_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "kazma.yaml").write_text(UNREACHABLE)
    result = _kazma(tmp_path, "run", KAZMA_PG_PASSWORD="hunter2", **TOKENS)
    assert result.returncode == 2, result.stderr
    [line] = [line for line in result.stderr.splitlines() if "store.url" in line]
    assert "cannot use PostgreSQL at postgresql://kazma:***@127.0.0.1:1/kazma" in line
    assert "hunter2" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kazma.yaml"]  # nothing started or created


def test_kazma_run_on_postgresql_needs_the_console_tokens_every_replica_shares(tmp_path: Path) -> None:
    (tmp_path / "kazma.yaml").write_text(UNREACHABLE)
    result = _kazma(tmp_path, "run", KAZMA_PG_PASSWORD="pw", KAZMA_WEB_TOKEN="o" * 40)
    assert result.returncode == 2, result.stderr
    assert "every replica must share the console's tokens: set KAZMA_WEB_READER_TOKEN" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [["approvals", "list"], ["doctor"]])
def test_commands_on_a_postgresql_they_cannot_reach_say_so_in_one_line(tmp_path: Path, command: list[str]) -> None:
    (tmp_path / "kazma.yaml").write_text(UNREACHABLE)
    result = _kazma(tmp_path, *command, KAZMA_PG_PASSWORD="hunter2")
    assert "cannot use PostgreSQL at postgresql://kazma:***@127.0.0.1:1/kazma" in result.stdout + result.stderr
    assert "hunter2" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.returncode != 0


async def _made_as_kazma_run_makes_it(config: Path) -> None:
    loaded = load_config(config)
    await (await open_pg_store(loaded.config)).close()


def test_commands_run_on_a_postgresql_store(tmp_path: Path, pg_dsn: str) -> None:
    (tmp_path / "kazma.yaml").write_text(f"store: {{url: '{pg_dsn}'}}\napprovals: {{approvers: ['cli:alice']}}\n")
    # An empty database is no Kazma store: a read-only command once applied Kazma's schema to it and said
    # "no approval requests". Doctor says so too, and neither makes it.
    refused = _kazma(tmp_path, "approvals", "list")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    redacted = load_config_text(f"store: {{url: '{pg_dsn}'}}\n", environ={}).config.store.redacted_url
    assert refused.stderr.splitlines()[-1].endswith(
        f"store.url: no Kazma store in {redacted}: kazma run creates it; check the URL"
    )
    swarm = _kazma(tmp_path, "swarm", "status")  # the terminal's swarm builds the app: it migrated too
    assert swarm.returncode == 2, swarm.stdout + swarm.stderr
    assert swarm.stderr.splitlines()[-1] == refused.stderr.splitlines()[-1]
    early = _kazma(tmp_path, "doctor")
    assert f"OK    store             no Kazma store in {redacted} yet: kazma run creates it there" in early.stdout
    assert " replicas " not in early.stdout  # nothing to ask before the store is there
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT to_regclass('kazma_schema')").fetchone() == (None,)
    asyncio.run(_made_as_kazma_run_makes_it(tmp_path / "kazma.yaml"))
    listed = _kazma(tmp_path, "approvals", "list")
    assert listed.returncode == 0, listed.stderr
    doctor = _kazma(tmp_path, "doctor")
    [store_line] = [line for line in doctor.stdout.splitlines() if " store " in f" {line} "]
    assert store_line.startswith("OK"), doctor.stdout
    assert "PostgreSQL" in store_line
    # people (v9), the audit chain (v10), policies (v11), bound cards (v12), the one-statement press (v13),
    # the press sent on a guess (v14), the audit append's rows by subscript (v15), reposted cards (v16), the
    # guessed press as one function (v17), the leaner audit append and the checkpoint on a guess (v18), the
    # guessed audit append's stale guess (v19), the tool definition a request was opened for (v20)
    assert "approvals v20" in store_line
    assert "audit_sink v1" in store_line
    [replicas_line] = [line for line in doctor.stdout.splitlines() if " replicas " in f" {line} "]
    assert replicas_line.split() == ["OK", "replicas", "none", "running"]


def _pg_schema(dsn: str) -> list[tuple[str, int]]:
    with psycopg.connect(dsn) as conn:
        return [(str(c), int(v)) for c, v in conn.execute("SELECT component, version FROM kazma_schema ORDER BY 1, 2")]


def test_a_postgresql_store_an_older_kazma_made_is_read_by_no_command_that_would_migrate_it(
    tmp_path: Path, pg_dsn: str
) -> None:
    """A read-only command once applied the missing migrations to the database a running older Kazma served
    from; it refuses now, in one line, and only `kazma store migrate` (or `kazma run`) upgrades it."""
    from click.testing import CliRunner

    from kazma.bot.cli import main
    from kazma.bot.store import pg_migrations
    from kazma.config.store.postgres import open_pg_store as open_pg

    older = pg_migrations()[:-1]

    async def made_by_an_older_kazma() -> None:
        await (await open_pg(pg_dsn, migrations=older)).close()

    asyncio.run(made_by_an_older_kazma())
    before = _pg_schema(pg_dsn)
    config = tmp_path / "kazma.yaml"
    config.write_text(f"store: {{url: '{pg_dsn}'}}\nmodel: {{base_url: 'http://127.0.0.1:9/v1'}}\n")
    redacted = load_config_text(f"store: {{url: '{pg_dsn}'}}\n", environ={}).config.store.redacted_url
    last = pg_migrations()[-1]
    lag = f"at schema {len(older)}, this Kazma needs {len(older) + 1} (missing {last.component} v{last.version})"
    for command in (["approvals", "list"], ["swarm", "status"], ["audit", "export"]):
        result = CliRunner().invoke(main, ["-c", str(config), "--log-level", "error", *command])
        assert result.exit_code == 2, result.output
        assert result.stderr.splitlines()[-1] == (
            f"{config}: store.url: the Kazma store at {redacted} is {lag}: kazma store migrate (or kazma run) "
            "upgrades it; nothing changed"
        )
    doctor = CliRunner().invoke(main, ["-c", str(config), "--log-level", "error", "doctor", "--model-timeout", "1"])
    assert f"WARN  store             {redacted}: {lag}: kazma run (or kazma store migrate)" in doctor.output
    assert _pg_schema(pg_dsn) == before
    migrated = CliRunner().invoke(main, ["-c", str(config), "--log-level", "error", "store", "migrate"])
    assert migrated.output == f"applied 1 migrations: {last.component} v{last.version}\n", migrated.output
    assert len(_pg_schema(pg_dsn)) == len(before) + 1
    listed = CliRunner().invoke(main, ["-c", str(config), "--log-level", "error", "approvals", "list"])
    assert listed.output == "no approval requests\n", listed.output


def test_doctor_names_a_postgresql_it_cannot_reach_once_in_its_store_line(tmp_path: Path) -> None:
    """The line once read "<url>: cannot open: kazma.yaml: store.url: cannot use PostgreSQL at <url>: …"."""
    from click.testing import CliRunner

    from kazma.bot.cli import main

    config = tmp_path / "kazma.yaml"
    config.write_text(UNREACHABLE + "model: {base_url: 'http://127.0.0.1:9/v1'}\n")
    result = CliRunner().invoke(
        main,
        ["-c", str(config), "--log-level", "error", "doctor", "--model-timeout", "1"],
        env={"KAZMA_PG_PASSWORD": "hunter2"},
    )
    assert result.exit_code == 1, result.output
    [line] = [line for line in result.output.splitlines() if line.split()[1:2] == ["store"]]
    assert line.startswith(
        "FAIL  store             cannot use PostgreSQL at postgresql://kazma:***@127.0.0.1:1/kazma: connection failed"
    ), line
    assert "hunter2" not in result.output
