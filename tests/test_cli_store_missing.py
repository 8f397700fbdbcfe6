"""Commands that read or act on Kazma's store refuse a store.path holding none, and create nothing there.

A mistyped store.path once got an empty store made and migrated on the spot, and the command answered from it:
`kazma approvals list` said "no approval requests", `kazma approvals rules list` "no remembered approvals in
force", both exit 0, while the requests waited in Kazma's real store elsewhere."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from kazma.bot.cli import main
from kazma.bot.store import all_migrations
from kazma.config.store.database import open_database

READERS = [
    ["approvals", "list"],
    ["approvals", "list", "--pending"],
    ["approvals", "show", "1"],
    ["approvals", "approve", "1"],
    ["approvals", "deny", "1"],
    ["approvals", "rules", "list"],
    ["approvals", "rules", "revoke", "1"],
    ["people", "list"],
    ["people", "revoke", "alice"],
    ["audit", "export"],
    ["swarm", "status"],
    ["swarm", "history"],
    ["swarm", "workers"],
    ["swarm", "cancel", "t-0001"],
    ["swarm", "show", "t-0001"],
]
CONFIG = "store: {{path: {store}}}\npeople: {{alice: {{web: alice, cli: root}}}}\napprovals: {{approvers: [alice]}}\n"


def _everything(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("command", READERS, ids=" ".join)
def test_a_missing_store_is_refused_naming_the_path_and_the_file(tmp_path: Path, command: list[str]) -> None:
    config = tmp_path / "kazma.yaml"
    config.write_text(CONFIG.format(store="typo/kazma.db"))
    result = CliRunner().invoke(main, ["-c", str(config), "--log-level", "error", *command])
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, result.output  # a configuration problem, as a store that cannot be opened
    where = tmp_path / "typo" / "kazma.db"
    assert result.stderr.splitlines()[-1] == (
        f"{config}: store.path: no Kazma store at {where}: kazma run creates it; check the path"
    )
    assert _everything(tmp_path) == ["kazma.yaml"]  # no store, no -wal/-shm, no folder, no keys


def test_a_sqlite_store_url_is_named_as_store_url(tmp_path: Path) -> None:
    config = tmp_path / "kazma.yaml"
    config.write_text(f"store: {{url: 'sqlite:///{tmp_path}/gone.db'}}\n")
    result = CliRunner().invoke(main, ["-c", str(config), "approvals", "rules", "list"])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (
        f"{config}: store.url: no Kazma store at {tmp_path}/gone.db: kazma run creates it; check the path"
    )
    assert _everything(tmp_path) == ["kazma.yaml"]


def _garbage(path: Path) -> None:
    path.write_bytes(b"not SQLite at all, but somebody's notes")


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _foreign(path: Path) -> None:
    """Another program's SQLite database, in WAL mode (whose readers make -wal and -shm files)."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.execute("INSERT INTO notes VALUES ('mine')")
    conn.commit()
    conn.close()


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (_garbage, "the file is not a SQLite database"),
        (_empty, "the file is empty"),
        (_foreign, "a SQLite database without Kazma's tables (no kazma_schema)"),
    ],
    ids=["garbage", "empty", "foreign-sqlite"],
)
@pytest.mark.parametrize(
    "command",
    [
        ["approvals", "list"],
        ["people", "list"],
        ["people", "invite", "alice"],
        ["swarm", "status"],
        ["swarm", "dispatch", "builder", "make", "it"],  # work it starts may make a store, never migrate a file
    ],
    ids=" ".join,
)
def test_a_file_that_is_not_a_kazma_store_is_refused_and_left_as_it_was(
    tmp_path: Path, make: object, said: str, command: list[str]
) -> None:
    store = tmp_path / "other.db"
    assert callable(make)
    make(store)
    before = store.read_bytes()
    config = tmp_path / "kazma.yaml"
    config.write_text(CONFIG.format(store=store))
    result = CliRunner().invoke(main, ["-c", str(config), "--log-level", "error", *command])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[-1] == (
        f"{config}: store.path: {store} is not a Kazma store: {said}; nothing changed"
    )
    assert store.read_bytes() == before  # no Kazma tables added, not switched to WAL
    assert _everything(tmp_path) == ["kazma.yaml", "other.db"]


def test_people_invite_still_makes_the_store_as_the_first_steps_say(tmp_path: Path) -> None:
    """README's first steps invite before the first `kazma run`: that link is the store's first row."""
    config = tmp_path / "kazma.yaml"
    config.write_text(CONFIG.format(store="state/kazma.db"))
    made = CliRunner().invoke(main, ["-c", str(config), "--log-level", "error", "people", "invite", "alice"])
    assert made.exit_code == 0, made.output
    assert (tmp_path / "state" / "kazma.db").is_file()
    listed = CliRunner().invoke(main, ["-c", str(config), "--log-level", "error", "people", "list"])
    assert listed.exit_code == 0, listed.output
    assert "1 enrolment link(s) open" in listed.output


def test_doctor_says_there_is_no_store_yet_and_makes_none(tmp_path: Path) -> None:
    config = tmp_path / "kazma.yaml"
    # port 9 on loopback: nothing listens there
    config.write_text(CONFIG.format(store="typo/kazma.db") + "model: {base_url: 'http://127.0.0.1:9/v1'}\n")
    result = CliRunner().invoke(main, ["-c", str(config), "--log-level", "error", "doctor", "--model-timeout", "1"])
    where = tmp_path / "typo" / "kazma.db"
    assert (
        f"OK    store             no Kazma store at {where} yet: kazma run creates it there; "
        "if Kazma has run before, store.path is not its store"
    ) in result.output
    assert "decision seals" not in result.output  # nothing to read: not "cannot read the store"
    assert _everything(tmp_path) == ["kazma.yaml"]  # it once answered "writable" by creating it


def test_doctor_names_a_file_that_is_not_a_kazma_store(tmp_path: Path) -> None:
    store = tmp_path / "other.db"
    _foreign(store)
    before = store.read_bytes()
    config = tmp_path / "kazma.yaml"
    config.write_text(CONFIG.format(store=store) + "model: {base_url: 'http://127.0.0.1:9/v1'}\n")
    result = CliRunner().invoke(main, ["-c", str(config), "--log-level", "error", "doctor", "--model-timeout", "1"])
    assert result.exit_code == 1
    assert f"FAIL  store             {store} is not a Kazma store: a SQLite database without Kazma's tables" in (
        result.output
    )
    assert store.read_bytes() == before


def test_store_copy_leaves_a_file_that_is_not_a_kazma_store_as_it_was(tmp_path: Path) -> None:
    """`store copy --from` once applied Kazma's migrations to the file first: another program's database got
    Kazma's tables before the copy even reached PostgreSQL."""
    store = tmp_path / "other.db"
    _foreign(store)
    before = store.read_bytes()
    # port 9 on loopback: nothing listens there, and the refusal comes before any connection
    result = CliRunner().invoke(
        main, ["store", "copy", "--to", "postgresql://kazma@127.0.0.1:9/kazma", "--from", str(store)]
    )
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines()[-1] == (
        f"kazma store copy: {store} is not a Kazma store: a SQLite database without Kazma's tables "
        "(no kazma_schema); nothing changed"
    )
    assert store.read_bytes() == before
    assert _everything(tmp_path) == ["other.db"]


def test_a_link_to_no_store_is_a_missing_store(tmp_path: Path) -> None:
    """A store.path that is a symbolic link whose target is gone: opening it made the file the link names."""
    (tmp_path / "moved").mkdir()
    link = tmp_path / "kazma.db"
    link.symlink_to(tmp_path / "moved" / "kazma.db")
    config = tmp_path / "kazma.yaml"
    config.write_text(CONFIG.format(store=link))
    result = CliRunner().invoke(main, ["-c", str(config), "approvals", "list"])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[-1] == (
        f"{config}: store.path: no Kazma store at {link}: kazma run creates it; check the path"
    )
    assert _everything(tmp_path) == ["kazma.db", "kazma.yaml", "moved"]  # the link alone, nothing behind it


READ_ONLY = [
    ["approvals", "list"],
    ["approvals", "show", "1"],
    ["approvals", "rules", "list"],
    ["people", "list"],
    ["audit", "export"],
    ["swarm", "status"],
    ["swarm", "history"],
    ["swarm", "workers"],
    ["swarm", "show", "t-0001"],
]


def _older_store(path: Path) -> str:
    """A store an earlier Kazma made: every migration of this one but the last; what a refusal says it lacks."""
    applied = all_migrations()[:-1]

    async def make() -> None:
        conn = await open_database(path, migrations=applied)
        await conn.close()

    asyncio.run(make())
    last = all_migrations()[-1]
    return f"at schema {len(applied)}, this Kazma needs {len(applied) + 1} (missing {last.component} v{last.version})"


@pytest.mark.parametrize("command", READ_ONLY, ids=" ".join)
def test_a_command_that_only_reads_refuses_an_older_store_and_leaves_it_as_it_was(
    tmp_path: Path, command: list[str]
) -> None:
    """These commands once migrated a store an older Kazma made, under that Kazma if it was still running (after
    an upgrade, before its restart), to answer a question that writes nothing."""
    store = tmp_path / "kazma.db"
    lag = _older_store(store)
    before = store.read_bytes()
    config = tmp_path / "kazma.yaml"
    config.write_text(CONFIG.format(store=store))
    result = CliRunner().invoke(main, ["-c", str(config), "--log-level", "error", *command])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[-1] == (
        f"{config}: store.path: the Kazma store at {store} is {lag}: kazma store migrate (or kazma run) upgrades it;"
        " nothing changed"
    )
    assert store.read_bytes() == before
    assert _everything(tmp_path) == ["kazma.db", "kazma.yaml"]


def test_store_migrate_upgrades_an_older_store_and_the_readers_then_read_it(tmp_path: Path) -> None:
    store = tmp_path / "kazma.db"
    _older_store(store)
    config = tmp_path / "kazma.yaml"
    config.write_text(CONFIG.format(store=store))
    last = all_migrations()[-1]
    migrated = CliRunner().invoke(main, ["-c", str(config), "--log-level", "error", "store", "migrate"])
    assert migrated.exit_code == 0, migrated.output
    assert migrated.output == f"applied 1 migrations: {last.component} v{last.version}\n"
    again = CliRunner().invoke(main, ["-c", str(config), "--log-level", "error", "store", "migrate"])
    assert again.output == "the store is already at this Kazma's schema: nothing changed\n"
    listed = CliRunner().invoke(main, ["-c", str(config), "--log-level", "error", "approvals", "list"])
    assert listed.exit_code == 0, listed.output
    assert listed.output == "no approval requests\n"


def test_store_migrate_makes_no_store_at_a_mistyped_path(tmp_path: Path) -> None:
    config = tmp_path / "kazma.yaml"
    config.write_text(CONFIG.format(store="typo/kazma.db"))
    result = CliRunner().invoke(main, ["-c", str(config), "store", "migrate"])
    assert result.exit_code == 2, result.output
    assert "no Kazma store at" in result.stderr
    assert _everything(tmp_path) == ["kazma.yaml"]


def test_doctor_says_an_older_store_is_upgraded_by_the_next_start_and_leaves_it(tmp_path: Path) -> None:
    store = tmp_path / "kazma.db"
    lag = _older_store(store)
    before = store.read_bytes()
    config = tmp_path / "kazma.yaml"
    config.write_text(CONFIG.format(store=store) + "model: {base_url: 'http://127.0.0.1:9/v1'}\n")
    result = CliRunner().invoke(main, ["-c", str(config), "--log-level", "error", "doctor", "--model-timeout", "1"])
    assert (
        f"WARN  store             {store}: {lag}: kazma run (or kazma store migrate) upgrades it; "
        "not read further until then"
    ) in result.output
    assert store.read_bytes() == before
