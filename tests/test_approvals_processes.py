"""Two OS processes deciding against one database file, and the CLI deciding from outside."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kazma.approvals import Decision, Status
from kazma.bot.cli.cli_identity import system_login
from tests.approvals_support import APPROVERS_YAML, approval_service, assert_one_winner_each
from tests.child_env import child_env

PRESSER = textwrap.dedent(
    """
    import asyncio, json, sys
    from kazma.approvals import Decision, button_data
    from tests.approvals_support import approval_service

    async def main(path, actor, platform, flip):
        ids = json.loads(sys.stdin.readline())
        sys.stdin.readline()  # go
        async with approval_service(path) as service:
            presses = [
                button_data(rid, Decision.APPROVE if (i + flip) % 2 == 0 else Decision.DENY)
                for i, rid in enumerate(ids)
            ]
            results = await asyncio.gather(
                *(service.decide_from_button(p, actor=actor, platform=platform) for p in presses)
            )
        out = []
        for rid, r in zip(ids, results):
            o = r.outcome
            out.append([rid, r.verdict.value, o.status.value if o else None, o.decided_by if o else None])
        print(json.dumps(out))

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
    """
)

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
async def test_two_processes_press_every_request_exactly_one_winner(tmp_path: Path) -> None:
    path = tmp_path / "k.db"
    async with approval_service(path) as service:
        ids = [(await service.open("shell", {"n": i}, "agent:b", "web:c")).id for i in range(1000)]

    env = child_env()
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            PRESSER,
            str(path),
            actor,
            platform,
            str(flip),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=REPO,
        )
        for actor, platform, flip in (("telegram:111", "telegram", 0), ("slack:U111", "slack", 1))
    ]
    payload = (json.dumps(ids) + "\n").encode()
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(payload)
        await proc.stdin.drain()
    for proc in procs:  # release both only once both have their ids
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
    outputs = await asyncio.gather(*(asyncio.wait_for(p.communicate(), timeout=300) for p in procs))
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err.decode()[-3000:]
    results = [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outputs]

    async with approval_service(path) as service:
        rows = {r.id: r for r in await service.store.requests(limit=5000)}
        decided_events = await service.store.events(event="decided")
    assert len(decided_events) == 1000
    assert_one_winner_each(ids, rows, results)


def _cli(args: list[str], config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", "-c", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_cli_decision_in_another_process_wakes_the_waiter(tmp_path: Path) -> None:
    db = tmp_path / "k.db"
    me = system_login()  # the command line is the system user running it; people: says whose that is
    config = tmp_path / "kazma.yaml"
    config.write_text(APPROVERS_YAML + f"store: {{path: {db}}}\npeople: {{ops: {{cli: '{me}'}}}}\n")
    async with approval_service(db, poll_interval=0.2) as service:
        request = await service.open("shell", {"command": "make deploy"}, "agent:builder", "slack:C1")
        waiter = asyncio.create_task(service.wait(request.id))

        listed = await asyncio.to_thread(_cli, ["approvals", "list", "--pending"], config)
        assert listed.returncode == 0
        assert request.id in listed.stdout
        assert "pending" in listed.stdout

        # ops is the person, but not an approver yet: refused, with the fix
        refused = await asyncio.to_thread(_cli, ["approvals", "approve", request.id], config)
        assert refused.returncode == 1
        assert f"You (ops (cli:{me})) are not an approver here" in refused.stdout
        assert "add 'ops' to approvals.approvers" in refused.stderr
        # --as names nobody else: it only confirms who runs the command
        claimed = await asyncio.to_thread(_cli, ["approvals", "approve", request.id, "--as", "mallory"], config)
        assert claimed.returncode == 2
        assert f"you are cli:{me} (ops) on this machine: --as mallory would be someone else" in claimed.stderr

        config.write_text(config.read_text().replace('"cli:ops"]', '"cli:ops", ops]'))
        approved = await asyncio.to_thread(_cli, ["approvals", "approve", request.id], config)
        assert approved.returncode == 0, approved.stderr
        assert approved.stdout.strip() == f"Approved. Recorded as ops (cli:{me})."

        outcome = await asyncio.wait_for(waiter, timeout=30)
        assert (outcome.status, outcome.decided_by, outcome.decided_via, outcome.person) == (
            Status.APPROVED, f"cli:{me}", "cli", "ops",
        )  # fmt: skip

        again = await asyncio.to_thread(_cli, ["approvals", "deny", request.id, "--as", "ops"], config)
        assert again.returncode == 1
        assert again.stdout.startswith(f"Already approved by ops (cli:{me}) via cli at ")

    shown = await asyncio.to_thread(_cli, ["approvals", "show", request.id], config)
    assert shown.returncode == 0
    assert '{"command":"make deploy"}' in shown.stdout
    assert request.args_hash in shown.stdout
    assert f"outcome    approved by ops (cli:{me}) via cli at" in shown.stdout
    for event in ("opened agent:builder", f"press_refused ops (cli:{me}) via cli", f"decided ops (cli:{me}) via cli",
                  "press_lost"):  # fmt: skip
        assert event in shown.stdout
    missing = await asyncio.to_thread(_cli, ["approvals", "show", "nope"], config)
    assert missing.returncode == 1
    assert "no approval request 'nope'" in missing.stderr


async def test_cli_list_empty(tmp_path: Path) -> None:
    config = tmp_path / "kazma.yaml"
    config.write_text(f"store: {{path: {tmp_path / 'k.db'}}}\n")
    async with approval_service(tmp_path / "k.db"):
        pass  # the store Kazma made, with nothing in it (a list never makes one: tests/test_cli_store_missing.py)
    result = await asyncio.to_thread(_cli, ["approvals", "list"], config)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "no approval requests"
    assert Decision.APPROVE.code == "a"


TROJAN = "echo hi; true \u202e # ; rm -rf ~ \x9b2K\x85 git\u200bhub \x7f"


async def test_cli_show_escapes_what_a_terminal_would_obey_and_warns_as_the_cards_do(tmp_path: Path) -> None:
    # `show` is where a call too long for a chat card is read whole before `approve`.
    db = tmp_path / "k.db"
    config = tmp_path / "kazma.yaml"
    config.write_text(APPROVERS_YAML + f"store: {{path: {db}}}\n")
    async with approval_service(db) as service:
        request = await service.open("shell\u202e", {"command": TROJAN}, "agent:builder\u200b", "slack:C1")
        changed = await service.open("shell", {"command": "rm -rf /srv"}, "agent:builder", "slack:C1")
    with sqlite3.connect(db) as raw:
        raw.execute("UPDATE approval_requests SET args_json = ? WHERE id = ?", ('{"command":"ls"}', changed.id))

    shown = await asyncio.to_thread(_cli, ["approvals", "show", request.id], config)
    assert shown.returncode == 0, shown.stderr
    for raw_char in ("\u202e", "\x9b", "\x85", "\u200b", "\x7f"):
        assert raw_char not in shown.stdout, repr(raw_char)
    for escape in ("⟨U+202E RLO⟩", "⟨U+009B CSI⟩", "⟨U+0085 NEL⟩", "⟨U+200B ZWSP⟩", "⟨U+007F DEL⟩"):
        assert escape in shown.stdout
    first = shown.stdout.splitlines()[0]
    assert first.startswith("warning    Hidden or control characters in the tool name")
    assert "warning    Hidden or control characters in argument 'command'" in shown.stdout
    assert "tool       shell⟨U+202E RLO⟩" in shown.stdout
    assert request.args_hash in shown.stdout

    listed = await asyncio.to_thread(_cli, ["approvals", "list"], config)
    assert listed.returncode == 0, listed.stderr
    assert "\u202e" not in listed.stdout
    assert "\u200b" not in listed.stdout
    assert "shell⟨U+202E RLO⟩" in listed.stdout

    tampered = await asyncio.to_thread(_cli, ["approvals", "show", changed.id], config)
    assert tampered.returncode == 0, tampered.stderr
    assert tampered.stdout.startswith("warning    The stored call no longer matches the hash it was opened with")
