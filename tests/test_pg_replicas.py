"""Three OS processes — three replicas — pressing every request on one PostgreSQL database."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path

import pytest

from kazma.approvals import ApprovalService, ApprovalStore
from kazma.bot.store import pg_migrations
from kazma.config.store.postgres import open_pg_store
from tests.approvals_support import approvals_config, assert_one_winner_each
from tests.child_env import child_env
from tests.pg_support import find_bindir

REQUESTS = 1000
REPLICAS = (("telegram:111", "telegram", 0), ("slack:U111", "slack", 1), ("discord:222", "discord", 2))
WAIT = 120.0  # bound on one replica's whole run; it takes seconds

PRESSER = textwrap.dedent(
    """
    import asyncio, json, sys
    from kazma.approvals import ApprovalService, ApprovalStore, Decision, button_data
    from kazma.bot.store import pg_migrations
    from kazma.config.store.postgres import open_pg_store
    from tests.approvals_support import approvals_config, assert_one_winner_each

    async def main(dsn, actor, platform, flip):
        ids = json.loads(sys.stdin.readline())
        backend = await open_pg_store(dsn, migrations=pg_migrations(), application_name=f"replica-{platform}")
        try:
            service = ApprovalService(ApprovalStore(backend), approvals_config())
            presses = [
                button_data(rid, Decision.APPROVE if (i + flip) % 2 == 0 else Decision.DENY)
                for i, rid in enumerate(ids)
            ]
            print("ready", flush=True)
            sys.stdin.readline()  # go
            results = await asyncio.gather(
                *(service.decide_from_button(p, actor=actor, platform=platform) for p in presses)
            )
        finally:
            await backend.close()
        out = []
        for rid, r in zip(ids, results):
            o = r.outcome
            out.append([rid, r.verdict.value, o.status.value if o else None, o.decided_by if o else None])
        print(json.dumps(out), flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
    """
)

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
async def test_three_replicas_press_every_request_exactly_one_winner(request: pytest.FixtureRequest) -> None:
    if find_bindir() is None:
        pytest.skip("PostgreSQL server binaries are not installed: run scripts/install-test-deps")
    dsn = str(request.getfixturevalue("pg_dsn"))
    backend = await open_pg_store(dsn, migrations=pg_migrations())
    try:
        service = ApprovalService(ApprovalStore(backend), approvals_config())
        opened = await asyncio.gather(*(service.open("shell", {"n": i}, "agent:b", "web:c") for i in range(REQUESTS)))
        ids = [r.id for r in opened]

        env = child_env()
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                PRESSER,
                dsn,
                actor,
                platform,
                str(flip),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                cwd=REPO,
            )
            for actor, platform, flip in REPLICAS
        ]
        try:
            payload = (json.dumps(ids) + "\n").encode()
            for proc in procs:
                assert proc.stdin is not None
                assert proc.stdout is not None
                proc.stdin.write(payload)
                await proc.stdin.drain()
            for proc in procs:  # every replica connected and ready before any presses
                assert proc.stdout is not None
                line = await asyncio.wait_for(proc.stdout.readline(), WAIT)
                assert line == b"ready\n", line
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write(b"go\n")
                await proc.stdin.drain()
            outputs = await asyncio.gather(*(asyncio.wait_for(p.communicate(), WAIT) for p in procs))
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
        for proc, (_, err) in zip(procs, outputs, strict=True):
            assert proc.returncode == 0, err.decode()[-3000:]
        results = [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outputs]

        rows = {r.id: r for r in await service.store.requests(limit=REQUESTS * 2)}
        assert [len(per_replica) for per_replica in results] == [REQUESTS] * len(results)
        assert_one_winner_each(ids, rows, results)
        assert len(await service.store.events(event="decided")) == REQUESTS
        assert len(await service.store.events(event="press_lost")) == REQUESTS * (len(REPLICAS) - 1)
    finally:
        await backend.close()
