"""``store.url``: a SQLite path or a PostgreSQL URL, anything else refused; `kazma run` refuses PostgreSQL for now."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kazma.config import load_config_text
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


def test_kazma_run_refuses_postgresql_naming_what_is_missing(tmp_path: Path) -> None:
    # In a process of its own: the CLI configures logging for the whole process.
    (tmp_path / "kazma.yaml").write_text("store: {url: 'postgresql://kazma:${KAZMA_PG_PASSWORD}@127.0.0.1:1/kazma'}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAZMA_")}
    result = subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", "-c", "kazma.yaml", "run"],
        cwd=tmp_path,  # the default store.path is relative: nothing may appear here
        env={**env, "KAZMA_PG_PASSWORD": "pw"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "store.url: `kazma run` does not run on PostgreSQL yet" in result.stderr
    assert "plans, history, swarm tasks" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kazma.yaml"]  # nothing started or created


@pytest.mark.parametrize("command", [["approvals", "list"], ["doctor"]])
def test_commands_that_open_the_store_refuse_postgresql_in_one_line(tmp_path: Path, command: list[str]) -> None:
    (tmp_path / "kazma.yaml").write_text(
        "store: {url: 'postgresql://kazma:pw@127.0.0.1:1/kazma'}\napprovals: {approvers: ['cli:alice']}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAZMA_")}
    result = subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", "-c", "kazma.yaml", *command],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "does not run on PostgreSQL yet" in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.returncode != 0
