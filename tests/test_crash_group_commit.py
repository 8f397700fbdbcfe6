"""SIGKILL while group commits carry many presses: each press decided with its audit row, or left nothing.

A child process presses 3 × 30 requests at a time without pause and prints
each press's answer the moment it has it. The test kills it mid-stream, then
reads the store: every request is either decided — with exactly one
``decided`` audit row naming the winner — or still pending with no trace of
a press, and every press the child was told it won is in the store as won.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from kazma.approvals import Status
from tests.approvals_support import approval_service
from tests.child_env import child_env

PRESSER = textwrap.dedent(
    """
    import asyncio, json, sys
    from kazma.approvals import Decision, button_data
    from tests.approvals_support import approval_service

    PRESSERS = (("telegram:111", "telegram"), ("slack:U111", "slack"), ("discord:222", "discord"))

    async def main(path):
        ids = json.loads(sys.stdin.readline())
        async with approval_service(path) as service:
            async def press(rid, actor, platform, n):
                decision = Decision.APPROVE if n % 2 == 0 else Decision.DENY
                result = await service.decide_from_button(button_data(rid, decision), actor=actor, platform=platform)
                # answered: the commit holding this press is on disk
                print(json.dumps([rid, actor, result.verdict.value]), flush=True)

            for start in range(0, len(ids), 30):
                await asyncio.gather(*(
                    press(rid, actor, platform, n)
                    for n, rid in enumerate(ids[start:start + 30])
                    for actor, platform in PRESSERS
                ))

    asyncio.run(main(sys.argv[1]))
    """
)

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
async def test_sigkill_during_group_commits_keeps_every_answered_press_and_no_half_press(tmp_path: Path) -> None:
    path = tmp_path / "k.db"
    async with approval_service(path) as service:
        ids = [(await service.open("shell", {"n": i}, "agent:b", "web:c")).id for i in range(900)]

    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        PRESSER,
        str(path),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env=child_env(),
        cwd=REPO,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    child.stdin.write((json.dumps(ids) + "\n").encode())
    await child.stdin.drain()
    answered: list[tuple[str, str, str]] = []
    async with asyncio.timeout(120):
        while sum(verdict == "won" for _, _, verdict in answered) < 150:
            line = await child.stdout.readline()
            assert line, "the presser ended before it was killed"
            if line.startswith(b"["):
                rid, actor, verdict = json.loads(line)
                answered.append((rid, actor, verdict))
    child.send_signal(signal.SIGKILL)
    await child.wait()
    assert child.returncode == -signal.SIGKILL

    async with approval_service(path) as service:
        rows = {r.id: r for r in await service.store.requests(limit=10_000)}
        decided = await service.store.events(event="decided")
        lost = await service.store.events(event="press_lost")
    decided_rows = {rid: r for rid, r in rows.items() if r.status is not Status.PENDING}
    assert 150 <= len(decided_rows) < len(ids)  # killed mid-stream, with work left undone

    # one decision, one "decided" row naming the winner; a pending request carries no trace of a press
    by_request: dict[str, list[str | None]] = {}
    for event in decided:
        assert event.request_id is not None
        by_request.setdefault(event.request_id, []).append(event.actor)
    assert set(by_request) == set(decided_rows)
    for rid, row in decided_rows.items():
        assert row.status in (Status.APPROVED, Status.DENIED)
        assert by_request[rid] == [row.decided_by]
    assert not {e.request_id for e in lost} - set(decided_rows)  # a lost press only where someone won

    # every answer the presser got is what the store says
    for rid, actor, verdict in answered:
        row = rows[rid]
        if verdict == "won":
            assert row.decided_by == actor
        else:
            assert verdict == "lost"
            assert row.status is not Status.PENDING
            assert row.decided_by != actor
            assert any(e.request_id == rid and e.actor == actor for e in lost)
