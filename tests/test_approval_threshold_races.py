"""Five people press at once on a two-person policy, many times, on SQLite and PostgreSQL, in one process and
in two: each request gets exactly one outcome, the two reviews that crossed the threshold are on record and
nothing more; one person pressing on Telegram and Slack at once never reaches two.

Counts: 1,000 requests in one process on each store (each request: the five people and alice's second door
pressing at the same moment), and 1,000 requests raced by two OS processes on each store (three presses each
per request, released together once both processes are ready).
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kazma.approvals import ApprovalService, Decision, PressResult, PressVerdict
from tests.api_support import REPO
from tests.approvals_support import RecordingPublisher, approval_service
from tests.child_env import child_env
from tests.policy_support import ALICE_ON_SLACK, FIVE, policy_config
from tests.store_backends import Engine, raw_rows

IN_PROCESS = 1000
ACROSS_PROCESSES = 1000
CHUNK = 100  # requests raced at once in one process (every press of a request is in the same gather)

WON, COUNTED, LOST, REPEATED = (PressVerdict.WON, PressVerdict.COUNTED, PressVerdict.LOST, PressVerdict.REPEATED)


async def _open(service: ApprovalService, count: int, policy: str = "two") -> list[str]:
    ids: list[str] = []
    for start in range(0, count, CHUNK):
        opened = await asyncio.gather(
            *(
                service.open("shell", {"n": n}, "agent:builder", "telegram:-100", policy=policy)
                for n in range(start, min(count, start + CHUNK))
            )
        )
        ids += [r.id for r in opened]
    return ids


def _reviews(engine: Engine) -> dict[str, list[tuple[str, str]]]:
    found: dict[str, list[tuple[str, str]]] = {}
    for rid, reviewer, decision in raw_rows(engine, "SELECT request_id, reviewer, decision FROM approval_reviews"):
        found.setdefault(rid, []).append((reviewer, decision))
    return found


def _events(engine: Engine, event: str) -> Counter[str]:
    return Counter(r[0] for r in raw_rows(engine, "SELECT request_id FROM approval_events WHERE event = ?", (event,)))


def _statuses(engine: Engine) -> dict[str, tuple[str, str | None]]:
    rows = raw_rows(engine, "SELECT id, status, decided_person FROM approval_requests")
    return {r[0]: (r[1], r[2]) for r in rows}


def _check_two_people(engine: Engine, ids: Sequence[str], verdicts: dict[str, list[tuple[str, str, str]]]) -> None:
    """verdicts: request id -> [(person, actor, verdict)] of every press made on it."""
    reviews, decided, statuses = _reviews(engine), _events(engine, "decided"), _statuses(engine)
    reviewed = _events(engine, "reviewed")
    for rid in ids:
        status, decider = statuses[rid]
        assert status == "approved", (rid, status)
        assert (decided[rid], reviewed[rid]) == (1, 1), rid  # one outcome; one review short of it before
        counted = Counter(v for _, _, v in verdicts[rid])
        assert (counted[WON], counted[COUNTED]) == (1, 1), (rid, counted)
        assert set(counted) <= {WON, COUNTED, LOST, REPEATED}, counted
        crossing = {p for p, _, v in verdicts[rid] if v in (WON, COUNTED)}
        # exactly the two reviews that crossed the threshold, by the two presses told they counted
        assert sorted(reviews[rid]) == sorted((p, "approve") for p in crossing), (rid, reviews[rid], crossing)
        assert decider == next(p for p, _, v in verdicts[rid] if v == WON)
        alice = [v for p, _, v in verdicts[rid] if p == "alice"]
        assert sum(v in (WON, COUNTED) for v in alice) <= 1, alice  # her two doors count once at most


PEOPLE = policy_config().people


def _person(actor: str) -> str:
    return PEOPLE.person_of(actor) or actor


async def _press_all(
    service: ApprovalService, ids: Sequence[str], pressers: Sequence[tuple[str, str]]
) -> dict[str, list[tuple[str, str, str]]]:
    verdicts: dict[str, list[tuple[str, str, str]]] = {}
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        presses = [(rid, actor, platform) for rid in chunk for actor, platform in pressers]
        results: list[PressResult] = await asyncio.gather(
            *(service.decide(rid, Decision.APPROVE, actor=a, platform=p) for rid, a, p in presses)
        )
        for (rid, actor, _), result in zip(presses, results, strict=True):
            verdicts.setdefault(rid, []).append((_person(actor), actor, result.verdict.value))
    return verdicts


async def test_five_people_pressing_at_once_decide_a_two_person_request_once(store_engine: Engine) -> None:
    async with approval_service(store_engine.where, config=policy_config(), publisher=RecordingPublisher()) as service:
        ids = await _open(service, IN_PROCESS)
        verdicts = await _press_all(service, ids, [*FIVE, ALICE_ON_SLACK])
    _check_two_people(store_engine, ids, verdicts)


async def test_one_person_on_two_platforms_at_once_never_reaches_two(store_engine: Engine) -> None:
    async with approval_service(store_engine.where, config=policy_config(), publisher=RecordingPublisher()) as service:
        ids = await _open(service, 200)
        verdicts = await _press_all(service, ids, [FIVE[0], ALICE_ON_SLACK])
    statuses, reviews = _statuses(store_engine), _reviews(store_engine)
    for rid in ids:
        assert statuses[rid][0] == "pending"
        assert reviews[rid] == [("alice", "approve")]
        assert sorted(v for _, _, v in verdicts[rid]) == sorted([COUNTED, REPEATED])


async def test_a_denial_racing_approvals_leaves_one_consistent_outcome(store_engine: Engine) -> None:
    """Two denials and three approvals at once under approve: 2, deny: 1: approved on exactly two approving
    reviews and no denial, or denied by the first denial with at most one approval before it."""
    async with approval_service(store_engine.where, config=policy_config(), publisher=RecordingPublisher()) as service:
        ids = await _open(service, 300)
        presses = [(rid, actor, platform, Decision.DENY if i >= 3 else Decision.APPROVE)
                   for rid in ids for i, (actor, platform) in enumerate(FIVE)]  # fmt: skip
        results = []
        for start in range(0, len(presses), CHUNK * 5):
            chunk = presses[start : start + CHUNK * 5]
            results += await asyncio.gather(*(service.decide(rid, d, actor=a, platform=p) for rid, a, p, d in chunk))
    wins = Counter(rid for (rid, *_), r in zip(presses, results, strict=True) if r.verdict is WON)
    assert set(wins.values()) == {1}
    assert set(wins) == set(ids)
    statuses, reviews, decided = _statuses(store_engine), _reviews(store_engine), _events(store_engine, "decided")
    seen: Counter[str] = Counter()
    for rid in ids:
        assert decided[rid] == 1
        kinds = Counter(d for _, d in reviews[rid])
        if statuses[rid][0] == "approved":
            assert kinds == {"approve": 2}, kinds
        else:
            assert statuses[rid][0] == "denied"
            assert kinds["deny"] == 1, kinds
            assert kinds["approve"] <= 1, kinds
        seen[statuses[rid][0]] += 1
    assert sum(seen.values()) == len(ids)


PRESSER = textwrap.dedent(
    """
    import asyncio, json, sys
    from kazma.approvals import Decision
    from tests.approvals_support import RecordingPublisher, approval_service
    from tests.policy_support import policy_config

    async def main(where, pressers):
        ids = json.loads(sys.stdin.readline())
        config = policy_config()
        async with approval_service(where, config=config, publisher=RecordingPublisher()) as service:
            print("ready", flush=True)
            sys.stdin.readline()  # go
            out = []
            for start in range(0, len(ids), 50):
                chunk = [(rid, a, p) for rid in ids[start:start + 50] for a, p in pressers]
                results = await asyncio.gather(
                    *(service.decide(rid, Decision.APPROVE, actor=a, platform=p) for rid, a, p in chunk)
                )
                out += [[rid, config.people.person_of(a) or a, a, r.verdict.value]
                        for (rid, a, _), r in zip(chunk, results)]
        print(json.dumps(out))

    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
    """
)


async def test_two_processes_pressing_together_decide_each_request_once(store_engine: Engine) -> None:
    async with approval_service(store_engine.where, config=policy_config(), publisher=RecordingPublisher()) as service:
        ids = await _open(service, ACROSS_PROCESSES)
    halves = ([*FIVE[:3]], [*FIVE[3:], ALICE_ON_SLACK])  # alice presses in both processes
    env = child_env()
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            PRESSER,
            store_engine.where,
            json.dumps(half),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=REPO,
        )
        for half in halves
    ]
    for proc in procs:
        assert proc.stdin is not None
        assert proc.stdout is not None
        proc.stdin.write((json.dumps(ids) + "\n").encode())
        await proc.stdin.drain()
        async with asyncio.timeout(60):
            assert (await proc.stdout.readline()).strip() == b"ready"
    for proc in procs:  # both are ready: release them together
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
    outputs = await asyncio.gather(*(asyncio.wait_for(p.communicate(), timeout=300) for p in procs))
    verdicts: dict[str, list[tuple[str, str, str]]] = {}
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err.decode()[-3000:]
        rows: list[list[Any]] = json.loads(out.decode().strip().splitlines()[-1])
        for rid, person, actor, verdict in rows:
            verdicts.setdefault(rid, []).append((person, actor, verdict))
    _check_two_people(store_engine, ids, verdicts)
