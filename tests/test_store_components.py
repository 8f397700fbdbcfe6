"""Every store besides approvals and the outbox, on SQLite and on PostgreSQL, through its public methods.

Each test runs twice (``store_engine``): once on a SQLite file, once on a fresh database of the suite's
PostgreSQL server, with every component's migrations (``all_migrations()`` / ``pg_migrations()``). The
swarm task store has its own file (tests/test_swarm_store.py), parametrised the same way.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kazma.adapters.contract import ChatMove
from kazma.approvals.model import Status
from kazma.approvals.rules import RuleStore
from kazma.approvals.store import ApprovalStore
from kazma.bot.api_store import IdempotencyKeys
from kazma.bot.chat_moves import ChatMoves
from kazma.bot.console.dashboard_data import HOUR, DashboardQueries
from kazma.bot.console.sessions import Opening, SessionStore
from kazma.bot.store import all_migrations, pg_migrations
from kazma.config.store.backend import StoreConnection, StoreTables, tables_of
from kazma.engine.history import HistoryStore
from kazma.engine.plan import PlanOrigin, PlanSpec, StepSpec, StepStatus
from kazma.engine.plan_store import PlanStore
from kazma.engine.swarm.state_store import SwarmStateStore, day_of
from kazma.engine.transcript import TranscriptStore
from tests.store_backends import Engine, open_store, raw_rows

T0 = 1_700_000_000.25  # a quarter second: float4 would lose it, double precision keeps it


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_every_component_has_a_postgresql_form_with_the_same_versions() -> None:
    sqlite = [(m.component, m.version) for m in all_migrations()]
    postgres = [(m.component, m.version) for m in pg_migrations()]
    assert postgres == sqlite


def _spec(*titles: str) -> PlanSpec:
    return PlanSpec(
        goal="ship the report",
        steps=[StepSpec(index=i, title=t, assignee="builder", input=f"do {t}") for i, t in enumerate(titles, 1)],
    )


# -- the table access itself -----------------------------------------------------------------------


async def test_tables_run_reads_back_and_transactions_roll_back_whole(store_engine: Engine) -> None:
    async with open_store(store_engine) as conn:
        tables = tables_of(conn)
        assert tables is tables_of(conn)  # one per connection or backend: stores sharing it share its order
        assert (
            await tables.run(
                "INSERT INTO chat_moves (platform, old_chat, new_chat, moved_at) VALUES (?, ?, ?, ?)",
                ("t", "1", "2", T0),
            )
            == 1
        )
        await tables.run_many(
            "INSERT INTO chat_moves (platform, old_chat, new_chat, moved_at) VALUES (?, ?, ?, ?)",
            [("t", "3", "4", T0), ("t", "5", "6", T0)],
        )
        await tables.run_many("INSERT INTO chat_moves (platform, old_chat, new_chat, moved_at) VALUES (?, ?, ?, ?)", [])
        assert await tables.one("SELECT COUNT(*) FROM chat_moves") == (3,)
        seen_inside: list[Any] = []
        with pytest.raises(RuntimeError, match="changed my mind"):
            await _delete_then_fail(tables, seen_inside)
        assert seen_inside == [1, (2,)]  # the body saw its own delete
        assert raw_rows(store_engine, "SELECT COUNT(*) FROM chat_moves") == [(3,)]
        async with tables.transaction() as tx:
            await tx.run_many("DELETE FROM chat_moves WHERE old_chat = ?", [("3",), ("5",)])
        async with tables.locked() as db:
            assert [tuple(r) for r in await db.all("SELECT old_chat FROM chat_moves")] == [("1",)]
        assert raw_rows(store_engine, "SELECT old_chat FROM chat_moves") == [("1",)]


async def test_transactions_of_two_backends_run_one_after_another(store_engine: Engine) -> None:
    """A read-then-write body is not interleaved with another's (SQLite's write lock; an advisory lock on PG)."""
    async with open_store(store_engine) as one, open_store(store_engine) as two:
        await tables_of(one).run(
            "INSERT INTO swarm_breakers (worker, state, failures, retry_at, updated_at) VALUES (?, ?, ?, ?, ?)",
            ("w", "closed", 0, T0, T0),
        )

        async def bump(conn: StoreConnection) -> None:
            async with tables_of(conn).transaction() as tx:
                row = await tx.one("SELECT failures FROM swarm_breakers WHERE worker = ?", ("w",))
                await asyncio.sleep(0)  # let the other body run, if anything let it
                await tx.run("UPDATE swarm_breakers SET failures = ? WHERE worker = ?", (int(row[0]) + 1, "w"))

        await asyncio.gather(*(bump(c) for c in [one, two] * 10))
        assert await tables_of(one).one("SELECT failures FROM swarm_breakers WHERE worker = ?", ("w",)) == (20,)


async def _delete_then_fail(tables: StoreTables, seen: list[Any]) -> None:
    async with tables.transaction() as tx:
        seen.append(await tx.run("DELETE FROM chat_moves WHERE old_chat = ?", ("1",)))
        seen.append(tuple(await tx.one("SELECT COUNT(*) FROM chat_moves")))
        raise RuntimeError("changed my mind")


# -- plans -------------------------------------------------------------------------------------------


async def test_plans_steps_events_and_questions(store_engine: Engine) -> None:
    clock = Clock()
    async with open_store(store_engine) as conn:
        plans = PlanStore(conn, clock=clock)
        plan = await plans.create("web:c", _spec("research", "build", "check"), PlanOrigin("do it", "web:a", ("f",)))
        assert (plan.conversation, plan.goal, plan.origin) == (
            "web:c",
            "ship the report",
            PlanOrigin("do it", "web:a", ("f",)),
        )
        assert [s.spec.title for s in plan.steps.values()] == ["research", "build", "check"]
        assert await plans.active_plan("web:c") == plan.id
        assert await plans.last_plan("web:c") == plan.id

        assert await plans.set_status(plan.id, 1, StepStatus.PENDING, StepStatus.IN_PROGRESS, count_attempt=True)
        assert not await plans.set_status(plan.id, 1, StepStatus.PENDING, StepStatus.IN_PROGRESS)  # dispatched once
        assert await plans.set_status(
            plan.id, 1, StepStatus.IN_PROGRESS, StepStatus.DONE, output_summary="notes", output_files=["a.md"]
        )
        await plans.set_input(plan.id, 2, "build from notes")
        loaded = await plans.load(plan.id)
        assert loaded is not None
        first = loaded.steps[1]
        assert (first.status, first.output_summary, first.output_files, first.attempts) == (
            StepStatus.DONE,
            "notes",
            ["a.md"],
            1,
        )
        assert loaded.steps[2].spec.input == "build from notes"
        assert await plans.with_steps_in(StepStatus.PENDING) == [(plan.id, 2), (plan.id, 3)]

        # the steps not started are replaced; a started one makes the replacement refuse
        assert await plans.replace_pending(plan.id, 2, [StepSpec(index=2, title="rebuild", assignee="builder")])
        replaced = await plans.load(plan.id)
        assert replaced is not None
        assert [s.spec.title for s in replaced.steps.values()] == ["research", "rebuild"]
        assert not await plans.replace_pending(plan.id, 1, [StepSpec(index=1, title="again", assignee="builder")])

        await plans.record(plan.id, "replaced", step=2, actor="agent:lead", detail="from 2")
        clock.now += 1
        await plans.record(plan.id, "note")
        events = await plans.events(plan.id)
        assert [(e.kind, e.step, e.actor, e.at) for e in events] == [
            ("replaced", 2, "agent:lead", T0),
            ("note", None, None, T0 + 1),
        ]
        assert events[0].seq < events[1].seq

        question = await plans.ask(
            plan_id=plan.id, step=2, attempt=1, kind="ask_user", conversation="web:c", asked_by="builder",
            question="which?", choices=("a", "b"), answerer="web:a",
        )  # fmt: skip
        assert question.choices == ("a", "b")
        await plans.question_posted(question.id, "m1")
        assert [q.message_id for q in await plans.open_questions("web:c")] == ["m1"]
        assert await plans.settle_question(question.id, "answered", answer="a", actor="web:a")
        assert not await plans.settle_question(question.id, "cancelled", answer=None, actor=None)
        settled = await plans.question(question.id)
        assert settled is not None
        assert (settled.status, settled.answer, settled.answered_by) == ("answered", "a", "web:a")
        assert await plans.open_questions() == []

        await plans.set_plan_status(plan.id, "done")
        assert await plans.plan_status(plan.id) == "done"
        assert await plans.active_plan("web:c") is None
        assert await plans.load("missing") is None


async def test_replacing_steps_refuses_when_one_starts_in_between(store_engine: Engine) -> None:
    async with open_store(store_engine) as conn:
        plans = PlanStore(conn)
        plan = await plans.create("web:c", _spec("a", "b"))
        results = await asyncio.gather(
            plans.set_status(plan.id, 2, StepStatus.PENDING, StepStatus.BLOCKED),
            plans.replace_pending(plan.id, 1, [StepSpec(index=1, title="new", assignee="builder")]),
            plans.set_status(plan.id, 1, StepStatus.PENDING, StepStatus.IN_PROGRESS),
        )
        loaded = await plans.load(plan.id)
        assert loaded is not None
        if results[1]:  # replaced first: step 1 is the new one, pending, and nothing of the old plan is left
            assert [s.spec.title for s in loaded.steps.values()] == ["new"]
        else:  # the start won: nothing was replaced
            assert [s.spec.title for s in loaded.steps.values()] == ["a", "b"]
            assert loaded.steps[1].status is StepStatus.IN_PROGRESS


async def test_ended_plans_older_than_the_retention_go_and_unfinished_ones_stay(store_engine: Engine) -> None:
    clock = Clock()
    day = 86400.0
    async with open_store(store_engine) as conn:
        plans = PlanStore(conn, clock=clock)
        finished = await plans.create("web:c", _spec("a"))
        await plans.record(finished.id, "repair", step=1, detail="retried")
        asked = await plans.ask(plan_id=finished.id, step=1, attempt=1, kind="ask_user", conversation="web:c",
                                asked_by="builder", question="which?", choices=("x",), answerer="web:a")  # fmt: skip
        await plans.settle_question(asked.id, "answered", answer="x", actor="web:a")
        await plans.set_plan_status(finished.id, "finished")
        aborted = await plans.create("web:c", _spec("a"))
        await plans.set_plan_status(aborted.id, "aborted")
        active = await plans.create("web:c", _spec("a"))  # never finished: kept however old
        open_question = await plans.create("web:c", _spec("a"))  # ended, but a person is still asked
        await plans.ask(plan_id=open_question.id, step=1, attempt=1, kind="ask_user", conversation="web:c",
                        asked_by="builder", question="still?", choices=(), answerer="web:a")  # fmt: skip
        await plans.set_plan_status(open_question.id, "finished")
        # Ended before ended_at was recorded: its steps' last update stands in.
        legacy = await plans.create("web:c", _spec("a"))
        await tables_of(conn).run("UPDATE plans SET status = 'finished' WHERE id = ?", (legacy.id,))
        clock.now += 10 * day
        recent = await plans.create("web:c", _spec("a"))
        await plans.set_plan_status(recent.id, "finished")
        clock.now += 1.0

        assert await plans.prune(11) == 0
        assert await plans.prune(10) == 3
        left = {str(r[0]) for r in raw_rows(store_engine, "SELECT id FROM plans")}
        assert left == {active.id, open_question.id, recent.id}
        for table in ("plan_steps", "plan_events", "plan_questions"):
            owners = raw_rows(store_engine, f"SELECT DISTINCT plan_id FROM {table}")  # noqa: S608 - fixed names
            assert {str(r[0]) for r in owners} <= left
            assert {str(r[0]) for r in owners} & {finished.id, aborted.id, legacy.id} == set()
        assert await plans.load(finished.id) is None
        assert await plans.load(active.id) is not None


async def test_transcript_older_than_the_retention_goes_with_titles_left_unused(store_engine: Engine) -> None:
    clock = Clock()
    day = 86400.0
    async with open_store(store_engine) as conn:
        transcript = TranscriptStore(conn, clock=clock)
        await transcript.record("telegram", "-1", author="telegram:1", name="a", text="old", direction="in",
                                title="Old group")  # fmt: skip
        await transcript.record("telegram", "-2", author="telegram:1", name="a", text="old too", direction="in",
                                title="Busy group")  # fmt: skip
        clock.now += 10 * day
        await transcript.record("telegram", "-2", author="agent:kazma", name="kazma", text="new", direction="out")
        clock.now += 1.0
        assert await transcript.prune(11) == 0
        assert await transcript.prune(10) == 2
        assert [e.text for e in await transcript.messages("telegram:-2")] == ["new"]
        assert await transcript.messages("telegram:-1") == []
        listed = await transcript.conversations()
        assert [(s.conversation, s.title, s.messages) for s in listed] == [("telegram:-2", "Busy group", 1)]


# -- history -----------------------------------------------------------------------------------------


async def test_history_is_bounded_with_a_marker_and_sums_usage(store_engine: Engine) -> None:
    async with open_store(store_engine) as conn:
        history = HistoryStore(conn, max_messages=3)
        for i in range(5):
            await history.append("web:c", "lead", "user" if i % 2 == 0 else "assistant", f"m{i}",
                                 prompt_tokens=10 * i, completion_tokens=i)  # fmt: skip
        await history.append("web:c", "builder", "user", "other agent")
        recent = await history.recent("web:c", "lead")
        assert [m["content"] for m in recent] == [
            "[2 earlier messages of this conversation were dropped to keep the history bounded]",
            "m2",
            "m3",
            "m4",
        ]
        assert [m["content"] for m in await history.recent("web:c", "builder")] == ["other agent"]
        assert await history.usage("web:c") == (100, 10)
        assert await history.usage("web:none") == (0, 0)


async def test_history_pruned_to_what_a_turn_reads_keeps_the_marker_and_usage_true(store_engine: Engine) -> None:
    # Every exchange added two rows forever, and recent() counted them all on every turn: a turn cost more as the
    # conversation aged. The sweep keeps the newest max_messages of each (conversation, agent) and remembers how
    # many went, so the marker still says exactly how many earlier messages there were.
    async with open_store(store_engine) as conn:
        history = HistoryStore(conn, max_messages=3)
        for i in range(7):
            await history.append("web:c", "lead", "user" if i % 2 == 0 else "assistant", f"m{i}",
                                 prompt_tokens=10 * i, completion_tokens=i)  # fmt: skip
        await history.append("web:c", "builder", "user", "other agent")
        before = await history.recent("web:c", "lead")
        assert before[0]["content"] == (
            "[4 earlier messages of this conversation were dropped to keep the history bounded]"
        )
        assert await history.prune() == 4
        lead_rows = "SELECT content FROM agent_history WHERE agent = 'lead' ORDER BY seq"
        assert raw_rows(store_engine, lead_rows) == [("m4",), ("m5",), ("m6",)]
        assert await history.recent("web:c", "lead") == before
        assert [m["content"] for m in await history.recent("web:c", "builder")] == ["other agent"]
        assert await history.usage("web:c") == (210, 21)
        assert await history.prune() == 0  # nothing left beyond the bound

        await history.append_exchange("web:c", "lead", "q", "a", prompt_tokens=5, completion_tokens=1)
        assert await history.prune() == 2  # added to what went before
        recent = await history.recent("web:c", "lead")
        assert [m["content"] for m in recent] == [
            "[6 earlier messages of this conversation were dropped to keep the history bounded]",
            "m6",
            "q",
            "a",
        ]
        assert await history.usage("web:c") == (215, 22)


async def test_a_turns_question_and_answer_are_written_as_one_pair(store_engine: Engine) -> None:
    async with open_store(store_engine) as conn:
        history = HistoryStore(conn)
        await history.append_exchange("web:c", "lead", "q\x00uestion", "answer", prompt_tokens=7, completion_tokens=3)
        assert await history.recent("web:c", "lead") == [
            {"role": "user", "content": "q\x00uestion"},
            {"role": "assistant", "content": "answer"},
        ]
        assert await history.usage("web:c") == (7, 3)


async def test_exchanges_appended_at_once_by_two_replicas_stay_in_pairs(store_engine: Engine) -> None:
    # On PostgreSQL two replicas' exchanges, sent with their writers' groups, took interleaved numbers: question,
    # question, answer, answer, so the history read back paired each question with another's answer. On SQLite
    # two connections without a writer did the same: each row of a run_many was a transaction of its own.
    async with open_store(store_engine) as one, open_store(store_engine, application_name="kazma-test-2") as two:
        stores = [HistoryStore(one, max_messages=1000), HistoryStore(two, max_messages=1000)]
        await asyncio.gather(*(stores[i % 2].append_exchange("web:c", "lead", f"q{i}", f"a{i}") for i in range(300)))
        contents = [m["content"] for m in await stores[0].recent("web:c", "lead")]
        assert len(contents) == 600
        pairs = list(zip(contents[0::2], contents[1::2], strict=True))
        assert [(q[1:], a[0]) for q, a in pairs if q[0] != "q" or a != "a" + q[1:]] == []
        assert sorted(int(q[1:]) for q, _ in pairs) == list(range(300))


# -- swarm state -------------------------------------------------------------------------------------


async def test_breakers_and_worker_days_add_up(store_engine: Engine) -> None:
    clock = Clock()
    async with open_store(store_engine) as conn:
        state = SwarmStateStore(conn, clock=clock)
        await state.save_breaker("builder", "open", 3, 30.0)
        await state.save_breaker("builder", "half_open", 4, 10.0)
        await state.save_breaker("aaa", "closed", 0, 0.0)
        saved = await state.breakers()
        assert [(b.worker, b.state, b.failures, b.retry_at) for b in saved] == [
            ("aaa", "closed", 0, T0),
            ("builder", "half_open", 4, T0 + 10.0),
        ]
        await state.record_call("builder", ok=True, latency=1.5, prompt_tokens=100, completion_tokens=20, cost=0.01)
        await state.record_call("builder", ok=False, latency=0.25, prompt_tokens=3_000_000_000, completion_tokens=1,
                                cost=0.02)  # fmt: skip
        clock.now -= 86400.0
        await state.record_call("builder", ok=True, latency=2.0, prompt_tokens=1, completion_tokens=1, cost=0.0)
        clock.now += 86400.0
        today, yesterday = await state.worker_days(2)
        assert (today.day, yesterday.day) == (day_of(T0), day_of(T0 - 86400.0))
        assert (today.completed, today.failed, today.calls, today.prompt_tokens, today.completion_tokens) == (
            1,
            1,
            2,
            3_000_000_100,
            21,
        )
        assert today.latency_seconds == pytest.approx(1.75)
        assert today.mean_latency == pytest.approx(0.875)
        assert today.cost == pytest.approx(0.03)
        assert [d.day for d in await state.worker_days(1)] == [day_of(T0)]


async def test_a_retry_ask_is_confirmed_once_whichever_replica_hears_the_confirmations(store_engine: Engine) -> None:
    clock = Clock()
    async with open_store(store_engine) as one, open_store(store_engine, application_name="kazma-test-2") as two:
        states = [SwarmStateStore(one, clock=clock), SwarmStateStore(two, clock=clock)]
        assert not await states[0].asked_again("slack:U1", "t1", 300.0)
        assert await states[1].asked_again("slack:U1", "t1", 300.0)  # the other replica's ask counts
        # 2 x 40 asks at once, from both: every confirmation uses one ask, none uses one twice
        answers = await asyncio.gather(*(states[i % 2].asked_again("slack:U1", "t2", 300.0) for i in range(80)))
        confirmed = answers.count(True)
        assert 1 <= confirmed <= answers.count(False)  # each confirmation used an ask of its own
        if not store_engine.postgres:
            assert confirmed == 40  # one writer at a time on the file: ask, confirm, ask, confirm...
        clock.now += 301.0
        assert not await states[0].asked_again("slack:U1", "t3", 300.0)
        clock.now += 301.0
        assert not await states[1].asked_again("slack:U1", "t3", 300.0)  # too late: a first ask again


# -- transcript --------------------------------------------------------------------------------------


async def test_transcript_keeps_order_and_lists_conversations(store_engine: Engine) -> None:
    clock = Clock()
    async with open_store(store_engine) as conn:
        transcript = TranscriptStore(conn, clock=clock)
        first = await transcript.record("telegram", "-100", author="telegram:1", name="Ann", text="hello",
                                        direction="in", message_id="7")  # fmt: skip
        clock.now += 1
        await transcript.record("web", "c", author="web:a", name="a", text="dm", direction="in", direct=True)
        clock.now += 1
        last = await transcript.record("telegram", "-100", author="agent:kazma", name="kazma", text="report.md",
                                       direction="out", message_id="8", file_name="report.md")  # fmt: skip
        assert first.seq < last.seq
        entries = await transcript.messages("telegram:-100")
        assert [(e.text, e.direction, e.file_name, e.at) for e in entries] == [
            ("hello", "in", None, T0),
            ("report.md", "out", "report.md", T0 + 2),
        ]
        assert [e.text for e in await transcript.messages("telegram:-100", limit=1)] == ["report.md"]
        summaries = await transcript.conversations()
        assert [(s.conversation, s.direct, s.messages, s.last_at, s.last_text) for s in summaries] == [
            ("telegram:-100", False, 2, T0 + 2, "report.md"),
            ("web:c", True, 1, T0 + 1, "dm"),
        ]


# -- sessions ----------------------------------------------------------------------------------------


async def test_sessions_open_find_expire_and_sweep(store_engine: Engine) -> None:
    clock = Clock()
    async with open_store(store_engine) as conn:
        sessions = SessionStore(conn, clock=clock)
        alice = Opening(login="alice", role="operator", proof="passkey", person="alice", identity="web:alice",
                        credential_id="cred-1")  # fmt: skip
        expires = await sessions.open("h1", alice, binding="b1", lifetime=60, max_sessions=2)
        assert expires == T0 + 60
        found = await sessions.find("h1")
        assert found is not None
        assert (found.login, found.role, found.binding, found.flash, found.created_at) == (
            "alice",
            "operator",
            "b1",
            (),
            T0,
        )
        assert (found.proof, found.person, found.identity, found.credential_id) == (
            "passkey", "alice", "web:alice", "cred-1",
        )  # fmt: skip
        await sessions.keep_flash("h1", [f"line {i}" for i in range(30)])
        clock.now += 5
        await sessions.seen("h1")
        found = await sessions.find("h1")
        assert found is not None
        assert (len(found.flash), found.flash[0], found.last_seen) == (20, "line 10", T0 + 5)

        reader = Opening(login="b", role="reader", proof="reader-token")
        await sessions.open("h2", reader, binding="b2", lifetime=120, max_sessions=2)
        await sessions.open("h3", reader, binding="b3", lifetime=120, max_sessions=2)
        await sessions.open("h4", reader, binding="b4", lifetime=300, max_sessions=2)
        assert await sessions.count() == 3  # the limit holds per opener: the reader token's two, and alice's
        assert await sessions.find("h2") is None  # the reader token's closest to expiring made room
        assert await sessions.find("h1") is not None  # never alice's, which expires first of all
        clock.now += 200
        assert await sessions.find("h3") is None  # expired: refused and deleted
        assert await sessions.find("h1") is None
        assert await sessions.count() == 1
        assert await sessions.end("h4")
        assert not await sessions.end("h4")


# -- remembered approvals ----------------------------------------------------------------------------


async def test_rules_match_exactly_expire_and_revoke(store_engine: Engine) -> None:
    clock = Clock()
    async with open_store(store_engine) as conn:
        rules = RuleStore(conn, clock=clock)
        rule = await rules.add(tool="shell", args_hash="h", conversation="web:c", created_by="web:a",
                               created_via="web", request_id="r1", seconds=3600)  # fmt: skip
        clock.now += 1
        short = await rules.add(tool="shell", args_hash="h", conversation="web:c", created_by="web:a",
                                created_via="web", request_id="r2", seconds=10)  # fmt: skip
        matched = await rules.match("shell", "h", "web:c")
        assert matched == rule  # the one lasting longest
        assert await rules.match("shell", "h", "web:other") is None
        assert await rules.match("shell", "other", "web:c") is None
        assert [r.id for r in await rules.list()] == [short.id, rule.id]
        clock.now += 20
        assert [r.id for r in await rules.list()] == [rule.id]
        assert [r.id for r in await rules.list(active_only=False)] == [short.id, rule.id]
        assert not await rules.revoke(short.id, actor="web:a")  # expired: it ended on its own, nothing to revoke
        assert await rules.in_force(short.id) is None
        assert await rules.in_force(rule.id) == rule
        assert await rules.revoke(rule.id, actor="web:a")
        assert not await rules.revoke(rule.id, actor="web:a")
        assert await rules.in_force(rule.id) is None
        assert await rules.match("shell", "h", "web:c") is None
        revoked = {r.id: r.revoked_at for r in await rules.list(active_only=False)}
        assert revoked == {rule.id: T0 + 21, short.id: None}


# -- chat moves and idempotency keys -----------------------------------------------------------------


async def test_chat_moves_are_kept_once_in_order(store_engine: Engine) -> None:
    async with open_store(store_engine) as conn:
        moves = ChatMoves(conn)
        assert await moves.record(ChatMove("telegram", "-1", "-1001"))
        assert not await moves.record(ChatMove("telegram", "-1", "-1001"))  # both chats announce it
        assert await moves.record(ChatMove("telegram", "-1001", "-1002"))
        assert await moves.all() == [ChatMove("telegram", "-1", "-1001"), ChatMove("telegram", "-1001", "-1002")]


async def test_idempotency_keys_are_kept_once_per_token(store_engine: Engine) -> None:
    async with open_store(store_engine) as conn:
        keys = IdempotencyKeys(conn)
        assert await keys.find("ci", "k1") is None
        assert await keys.keep("ci", "k1", "body", "req_1")
        assert not await keys.keep("ci", "k1", "other body", "req_2")
        assert await keys.keep("other-token", "k1", "body", "req_3")
        assert await keys.find("ci", "k1") == ("req_1", "body")
        assert await keys.find("other-token", "k1") == ("req_3", "body")


# -- the dashboard's own queries ---------------------------------------------------------------------


async def test_dashboard_queries_count_outcomes_waits_and_steps(store_engine: Engine) -> None:
    clock = Clock(T0 - T0 % HOUR + 1800)  # half past an hour
    async with open_store(store_engine) as conn:
        approvals = ApprovalStore(conn, clock=clock)
        ids = []
        for n in range(4):
            request = await approvals.insert(tool="shell", args_json=json.dumps({"n": n}), args_hash=f"h{n}",
                                             requested_by="agent:b", conversation="web:c", deadline=clock.now + 600,
                                             task_id=None)  # fmt: skip
            ids.append(request.id)
        clock.now += 12.5
        assert (await approvals.finish(ids[0], Status.APPROVED, actor="web:a", platform="web"))[0]
        assert (await approvals.finish(ids[1], Status.DENIED, actor="web:a", platform="web"))[0]
        assert (await approvals.finish(ids[2], Status.TIMEOUT, actor=None, platform=None))[0]
        plans = PlanStore(conn, clock=clock)
        plan = await plans.create("web:c", _spec("a", "b", "c"))
        assert await plans.set_status(plan.id, 1, StepStatus.PENDING, StepStatus.IN_PROGRESS)

        queries = DashboardQueries(conn, clock=clock)
        hours, waits, steps = await queries.charts()
        assert len(hours) == 24
        assert hours[-1].counts == {"approved": 1, "denied": 1, "timeout": 1}
        assert sum(sum(h.counts.values()) for h in hours[:-1]) == 0
        assert sorted(waits) == [12.5, 12.5]  # human decisions only
        assert steps == {"in_progress": 1, "pending": 2}
        assert await queries.decisions_since(clock.now + 1) == []


# -- what a replica that is gone left running -----------------------------------------------------


async def test_only_steps_and_tasks_of_replicas_that_are_gone_count_as_interrupted(store_engine: Engine) -> None:
    from kazma.engine.swarm.store import SwarmTaskStore
    from kazma.engine.swarm.types import Pattern

    async with open_store(store_engine) as conn:
        on_a, on_b, alone = PlanStore(conn, replica="a"), PlanStore(conn, replica="b"), PlanStore(conn)
        plans = [await store.create("c", _spec("one")) for store in (on_a, on_b, alone)]
        for store, plan in zip((on_a, on_b, alone), plans, strict=True):
            assert await store.set_status(plan.id, 1, StepStatus.PENDING, StepStatus.IN_PROGRESS, count_attempt=True)
        running = StepStatus.IN_PROGRESS
        assert await on_a.with_steps_in(running, live={"a", "b"}) == []
        assert await on_a.with_steps_in(running, live={"b"}) == [(plans[0].id, 1)]  # a is gone
        assert len(await on_a.with_steps_in(running)) == 3  # the only process restarted: every one

        tasks_a, tasks_b = SwarmTaskStore(conn, replica="a"), SwarmTaskStore(conn, replica="b")
        run_a = await tasks_a.admit(Pattern.DISPATCH, {"prompt": "p"}, owner="web:x")
        run_b = await tasks_b.admit(Pattern.DISPATCH, {"prompt": "q"}, owner="web:y")
        assert await tasks_b.recover(live={"a", "b"}) == []
        [lost] = await tasks_b.recover(live={"b"})
        assert lost.task_id == run_a.task_id
        assert (await tasks_b.get(run_b.task_id)).status.value == "running"  # type: ignore[union-attr]


async def test_a_paused_pipeline_of_a_gone_replica_is_adopted_by_exactly_one(store_engine: Engine) -> None:
    from kazma.engine.swarm.store import SwarmTaskStore
    from kazma.engine.swarm.types import Pattern

    async with open_store(store_engine) as conn:
        a, b, c = (SwarmTaskStore(conn, replica=name) for name in ("a", "b", "c"))
        run = await a.admit(Pattern.PIPELINE, {"prompt": "p"}, owner="web:x")
        assert await a.pause(run, "checkpoint:req1")
        assert await b.adopt_paused(live={"a", "b", "c"}) == []  # its replica waits for it
        adopted = await asyncio.gather(b.adopt_paused(live={"b", "c"}), c.adopt_paused(live={"b", "c"}))
        assert sorted(adopted, key=len) == [[], [run.task_id]]
        assert await b.adopt_paused(live={"b", "c"}) == []  # adopted once
