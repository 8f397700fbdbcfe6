"""A remembered approval is read once: what ``kazma approvals rules list`` and the console say of a rule
(rule_states) is what a call meets (ApprovalService.remembered). A rule shown ended, refused, expired or revoked
never lets a call run; one shown active lets its call run without a card, audited as a rule's use."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiosqlite
import pytest

from kazma.approvals import ApprovalService, ApprovalStore, Decision, PressVerdict, SafetyPolicy
from kazma.approvals import store as approvals_store
from kazma.approvals.rules import Rule, RuleState, RuleStore, rule_standing, rule_states
from kazma.approvals.service import CardLocation
from kazma.bot.store import all_migrations
from kazma.config import load_config_text
from kazma.config.keyring import DECISION_KEYS, Keyring
from kazma.config.metrics import failure_count
from kazma.config.store.database import open_database
from tests.approvals_support import TEST_KEYRING, ManualClock, RecordingPublisher

CONFIG = """
approvals:
  approvers: ["telegram:111", "telegram:222", "web:admin"]
  remember: {enabled: true, max_seconds: 3600}
"""
HERE = "telegram:-1001"
ARGS = {"env": "prod", "version": 42}


@dataclass
class Store:
    conn: aiosqlite.Connection
    clock: ManualClock

    def service(self, text: str = CONFIG, keyring: Keyring | None = TEST_KEYRING) -> ApprovalService:
        """A service on this store under ``text`` (a configuration changed since the rules were made, say)."""
        return ApprovalService(
            ApprovalStore(self.conn, clock=self.clock, keyring=keyring), load_config_text(text, environ={}).config,
            publisher=RecordingPublisher(), clock=self.clock, poll_interval=0.02,
            rules=RuleStore(self.conn, clock=self.clock),
        )  # fmt: skip

    async def remember(self, actor: str = "telegram:111") -> Rule:
        """The rule ``actor``'s "Approve for 1 h" press makes for the call ARGS, here."""
        service = self.service()
        request = await service.open("deploy", ARGS, "agent:kazma", HERE)
        pressed = await service.decide(
            request.id, Decision.APPROVE, actor=actor, platform="telegram", remember=True, card=CardLocation(None, None)
        )
        assert pressed.verdict is PressVerdict.WON
        assert service.rules is not None
        return next(r for r in await service.rules.list() if r.request_id == request.id)

    async def write(self, sql: str, params: tuple[object, ...] = ()) -> None:
        """A write around Kazma (an attacker with the store, or a hand repair)."""
        await self.conn.execute(sql, params)
        await self.conn.commit()


@asynccontextmanager
async def a_store(tmp: Path) -> AsyncIterator[Store]:
    conn = await open_database(tmp / "kazma.db", busy_timeout_ms=5000, migrations=all_migrations())
    try:
        yield Store(conn, ManualClock())
    finally:
        await conn.close()


async def _both_readings(service: ApprovalService) -> tuple[dict[str, RuleState], Rule | None]:
    """What the listing says of every rule, and which rule (if any) lets the call ARGS run here now."""
    assert service.rules is not None
    found = await service.rules.list(active_only=False)
    states = await rule_states(
        service.store, found, config=service.config, keyring=service.store.keyring, now=service.clock()
    )
    return {r.id: s for r, s in zip(found, states, strict=True)}, await service.remembered("deploy", ARGS, HERE)


def _assert_agree(states: dict[str, RuleState], used: Rule | None) -> None:
    """A rule shown not active never lets the call run; one shown active does (one of them, if several)."""
    if used is not None:
        assert states[used.id].stands, (used.id, states)
    assert (used is not None) == any(s.stands for s in states.values()), (used, states)


TWO = CONFIG + "  policies:\n    two: {approve: 2}\ntools:\n  deploy: {policy: two}\n"
PASSKEY = CONFIG + "  policies:\n    pk: {step_up: true}\ntools:\n  deploy: {policy: pk}\n"
OTHERS = CONFIG + '  policies:\n    ops: {approvers: ["telegram:222"]}\ntools:\n  deploy: {policy: ops}\n'


async def _nothing(store: Store, rule: Rule) -> None:
    return None


async def _revoke(store: Store, rule: Rule) -> None:
    assert await store.service().revoke_rule(rule.id, actor="cli:ops", platform="cli") is not None


async def _at_expiry(store: Store, rule: Rule) -> None:
    store.clock.now = rule.expires_at  # the first instant it no longer covers


async def _just_before_expiry(store: Store, rule: Rule) -> None:
    store.clock.now = rule.expires_at - 0.001


async def _past_a_lowered_max_seconds(store: Store, rule: Rule) -> None:
    store.clock.advance(120)


async def _revocation_undone_in_its_row(store: Store, rule: Rule) -> None:
    await _revoke(store, rule)
    await store.write("UPDATE approval_rules SET revoked_at = NULL, revoked_by = NULL WHERE id = ?", (rule.id,))


async def _approval_row_unreadable(store: Store, rule: Rule) -> None:
    sql = "UPDATE approval_requests SET reason = CAST(X'ff64' AS TEXT) WHERE id = ?"
    await store.write(sql, (rule.request_id,))


async def _unsealed_row_lasting_longer(store: Store, rule: Rule) -> None:
    await store.write(
        "INSERT INTO approval_rules (id, tool, args_hash, conversation, created_by, created_via, request_id,"
        " created_at, expires_at) VALUES ('rule_by_hand', ?, ?, ?, ?, ?, ?, ?, ?)",
        (rule.tool, rule.args_hash, rule.conversation, rule.created_by, rule.created_via, rule.request_id,
         rule.created_at, rule.expires_at + 60),
    )  # fmt: skip


async def _a_second_rule_by_222(store: Store, rule: Rule) -> None:
    store.clock.advance(10)  # made later, so it lasts longer and a call weighs it first
    await store.remember("telegram:222")


CASES: list[tuple[str, Callable[[Store, Rule], Awaitable[None]], str, str]] = [
    ("as made", _nothing, CONFIG, "active"),
    ("revoked", _revoke, CONFIG, "revoked"),
    ("at its expiry exactly", _at_expiry, CONFIG, "expired"),
    ("just before its expiry", _just_before_expiry, CONFIG, "active"),
    ("its maker no longer an approver", _nothing, CONFIG.replace('"telegram:111", ', ""), "ended"),
    ("its tool now under a policy its maker may not decide", _nothing, OTHERS, "ended"),
    ("remembered approvals turned off", _nothing, CONFIG.replace("enabled: true", "enabled: false"), "ended"),
    ("past a lowered max_seconds", _past_a_lowered_max_seconds, CONFIG.replace("3600", "60"), "ended"),
    ("its tool now under a policy of two", _nothing, TWO, "ended"),
    ("its tool now under a passkey policy", _nothing, PASSKEY, "ended"),
    ("revoked, then set back in force in its row", _revocation_undone_in_its_row, CONFIG, "refused"),
    ("its approval row unreadable", _approval_row_unreadable, CONFIG, "refused"),
    ("an unsealed row lasting longer beside it", _unsealed_row_lasting_longer, CONFIG, "active"),
    (
        "a later rule of another maker, then removed",
        _a_second_rule_by_222,
        CONFIG.replace(', "telegram:222"', ""),
        "active",
    ),
    (
        "a later rule of another maker, the first removed",
        _a_second_rule_by_222,
        CONFIG.replace('"telegram:111", ', ""),
        "ended",
    ),
]


@pytest.mark.parametrize(("case", "change", "config", "shown"), CASES, ids=[c[0] for c in CASES])
async def test_what_a_rule_is_shown_as_is_what_a_call_meets(
    tmp_path: Path, case: str, change: Callable[[Store, Rule], Awaitable[None]], config: str, shown: str
) -> None:
    async with a_store(tmp_path) as store:
        rule = await store.remember()
        await change(store, rule)
        states, used = await _both_readings(store.service(config))
        assert states[rule.id].name == shown, states[rule.id]
        _assert_agree(states, used)


async def test_without_the_decision_key_no_rule_is_shown_active_and_none_lets_a_call_run(tmp_path: Path) -> None:
    async with a_store(tmp_path) as store:
        rule = await store.remember()
        states, used = await _both_readings(store.service(keyring=None))
        assert states[rule.id].name == "unchecked"
        assert used is None


async def test_a_rule_now_under_a_policy_of_two_lets_no_call_run_even_asked_directly(tmp_path: Path) -> None:
    """Before: listed active, and remembered() let the call run; only SafetyPolicy's own check of the policy
    kept it from running, so any other caller of remembered() would have run a two-person call on one press."""
    async with a_store(tmp_path) as store:
        rule = await store.remember()
        service = store.service(TWO)
        [state] = await rule_states(service.store, [rule], config=service.config, keyring=TEST_KEYRING,
                                    now=store.clock())  # fmt: skip
        assert (state.name, state.why) == ("ended", "deploy's policy two now needs more than one person's press, "
                                                    "or a passkey")  # fmt: skip
        assert await service.remembered("deploy", ARGS, HERE) is None


async def _checked_without_a_card(service: ApprovalService) -> bool:
    """Whether SafetyPolicy lets the call ARGS run here without a card (a card asked for is denied)."""
    publisher = service.publisher
    assert isinstance(publisher, RecordingPublisher)
    task = asyncio.create_task(
        SafetyPolicy(service).check("deploy", ARGS, requested_by="agent:kazma", conversation=HERE)
    )
    async with asyncio.timeout(10):
        while not publisher.published and not task.done():
            await asyncio.sleep(0.01)
    if task.done():
        return task.result().allowed
    await service.decide_from_button(
        publisher.published[-1].button_data(Decision.DENY), actor="telegram:111", platform="telegram"
    )
    async with asyncio.timeout(10):
        assert not (await task).allowed
    return False


async def test_a_rule_that_no_longer_stands_does_not_hide_one_that_does(tmp_path: Path) -> None:
    """Before: a call weighed only the rule lasting longest; its maker no longer an approver, the call got a card
    while the listing showed the other rule active."""
    async with a_store(tmp_path) as store:
        first = await store.remember("telegram:111")
        store.clock.advance(10)
        await store.remember("telegram:222")
        service = store.service(CONFIG.replace(', "telegram:222"', ""))
        assert await _checked_without_a_card(service)
        used = [e for e in await service.store.events(first.request_id) if e.event == "rule_used"]
        assert len(used) == 1
        assert used[0].detail is not None
        assert used[0].detail.startswith(first.id)
        assert used[0].actor == "telegram:111"


async def test_a_rule_whose_approval_cannot_be_read_gets_the_call_a_card_and_is_audited_refused(
    tmp_path: Path,
) -> None:
    """Before: listed refused, while the call met an UnreadableRequest raised out of SafetyPolicy.check (no card:
    the agent's turn ended on an error)."""
    async with a_store(tmp_path) as store:
        rule = await store.remember()
        await _approval_row_unreadable(store, rule)
        service = store.service()
        assert not await _checked_without_a_card(service)
        refused = await service.store.events(rule.request_id, event="rule_refused")
        assert refused
        assert (refused[0].detail or "").startswith(f"{rule.id}: its approval {rule.request_id} cannot be read")


async def test_a_rule_that_cannot_be_read_gets_the_call_a_card(tmp_path: Path) -> None:
    """Before: the store's error on reading the rules came out of SafetyPolicy.check, ending the agent's turn
    on it (the call neither asked nor refused with a reason), where opening a request fails into a verdict."""
    async with a_store(tmp_path) as store:
        await store.remember()
        service = store.service()
        # A read of the rules that fails as a store's does (the table gone stands for a store refusing the read).
        await store.write("ALTER TABLE approval_rules RENAME TO approval_rules_away")
        before = failure_count("approval_rule_read")
        assert not await _checked_without_a_card(service)
        assert failure_count("approval_rule_read") == before + 1


async def test_on_another_replica_a_rule_reads_the_same_and_one_sealed_with_a_key_not_held_is_refused(
    tmp_path: Path,
) -> None:
    async with a_store(tmp_path) as store:
        rule = await store.remember()
        # Another replica: its own connection to the same store, its clock a little behind the maker's.
        conn = await open_database(tmp_path / "kazma.db", busy_timeout_ms=5000, migrations=all_migrations())
        try:
            other = Store(conn, ManualClock(store.clock() - 5))
            states, used = await _both_readings(other.service())
            assert states[rule.id].stands
            assert used is not None
            assert used.id == rule.id
            # One given other decision keys (the maker's retired there): the rule is refused, and lets nothing run.
            elsewhere = Keyring.of(DECISION_KEYS, ("k2", "another-decision-key-" + "0" * 32))
            states, used = await _both_readings(other.service(keyring=elsewhere))
            assert states[rule.id].name == "refused"
            assert states[rule.id].site == "approval_key_unknown"
            assert used is None
        finally:
            await conn.close()


async def test_a_listing_of_many_rules_reads_each_as_alone_in_a_few_queries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: rule_states read each rule's approval and its audit rows one rule at a time (three queries a rule:
    `kazma approvals rules list --all` over 1,000 rules made 3,000 round trips). Now a listing reads them all at
    once, and says of each exactly what reading that rule alone (the service's reading) says."""
    async with a_store(tmp_path) as store:
        made = [await store.remember() for _ in range(2)]
        store.clock.advance(3000)  # these two run out before the others
        made += [await store.remember(("telegram:111", "telegram:222")[i % 2]) for i in range(10)]
        await _revoke(store, made[2])
        await _revocation_undone_in_its_row(store, made[3])
        await _approval_row_unreadable(store, made[4])
        await _unsealed_row_lasting_longer(store, made[5])
        await store.write(
            "INSERT INTO approval_rules (id, tool, args_hash, conversation, created_by, created_via, request_id,"
            " created_at, expires_at) VALUES ('rule_of_nothing', 'deploy', ?, ?, 'telegram:111', 'telegram',"
            " 'no_such_request', ?, ?)",
            (made[6].args_hash, HERE, store.clock(), store.clock() + 600),
        )
        store.clock.advance(700)
        statements: list[str] = []
        await store.conn.set_trace_callback(statements.append)
        names: set[str] = set()
        for config, keyring in ((CONFIG, TEST_KEYRING), (CONFIG, None), (CONFIG.replace("3600", "600"), TEST_KEYRING)):
            service = store.service(config, keyring=keyring)
            assert service.rules is not None
            found = await service.rules.list(active_only=False)
            alone = [
                (await rule_standing(service.store, rule, config=service.config, keyring=keyring, now=store.clock()))[0]
                for rule in found
            ]
            statements.clear()
            listed = await rule_states(service.store, found, config=service.config, keyring=keyring, now=store.clock())
            assert listed == alone
            names |= {state.name for state in listed}
            assert len([s for s in statements if "FROM approval_events" in s]) <= 1, statements
            assert len([s for s in statements if "FROM approval_requests" in s]) <= 2, statements  # + an unreadable
        assert names == {"active", "revoked", "expired", "refused", "ended", "unchecked"}

        # Over more rules than one query binds: a query per part, the same states.
        monkeypatch.setattr(approvals_store, "IDS_PER_QUERY", 4)
        service = store.service()
        found = await service.rules.list(active_only=False) if service.rules is not None else []
        alone = [
            (await rule_standing(service.store, rule, config=service.config, keyring=TEST_KEYRING, now=store.clock()))[
                0
            ]
            for rule in found
        ]
        statements.clear()
        listed = await rule_states(service.store, found, config=service.config, keyring=TEST_KEYRING, now=store.clock())
        assert listed == alone
        audit_reads = len([s for s in statements if "FROM approval_events" in s])
        assert 2 <= audit_reads <= 3, statements


async def test_a_listing_over_an_unreadable_approval_with_an_unreadable_audit_row_reads_as_each_rule_alone(
    tmp_path: Path,
) -> None:
    """A request row and one of its decided audit rows holding bytes that are not UTF-8 (written around Kazma):
    reading the rule alone says "refused: its approval cannot be read" and never reads the audit rows. The listing
    read every listed request's audit rows in one query, which failed on that row: `kazma approvals rules list`
    and the console's rules view raised "Could not decode to UTF-8 column 'actor'" for every rule. Now a listing
    meeting such a row reads each rule's audit rows as reading it alone does."""
    async with a_store(tmp_path) as store:
        fine, bad = await store.remember("telegram:111"), await store.remember("telegram:222")
        await _approval_row_unreadable(store, bad)
        await store.write(
            "INSERT INTO approval_events (request_id, event, actor, platform, at, args_hash, detail)"
            " VALUES (?, 'decided', CAST(X'ff64' AS TEXT), 'telegram', 0, ?, 'approved')",
            (bad.request_id, bad.args_hash),
        )
        service = store.service()
        now = store.clock()
        rules = [fine, bad]
        alone = [
            (await rule_standing(service.store, r, config=service.config, keyring=TEST_KEYRING, now=now))[0]
            for r in rules
        ]
        assert [s.name for s in alone] == ["active", "refused"]
        listed = await rule_states(service.store, rules, config=service.config, keyring=TEST_KEYRING, now=now)
        assert listed == alone
