"""A remembered approval is an approval: only a rule Kazma made from a person's "Approve for …" press, sealed and
unchanged since, lets a call run without a card.

Each attack writes the store around Kazma (the writer of the database file, not a caller of Kazma's code) and
checks that the call gets a card instead, the refusal is counted and audited, and, for the requester, that a
rule never lets someone's own work past a policy that would not let them approve it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from kazma.approvals import MIGRATIONS, Decision, PressVerdict, SafetyPolicy
from kazma.approvals.rules import MIGRATIONS as RULES
from kazma.approvals.rules import Rule, RuleStore
from kazma.approvals.seal import FORGED, KEY_UNKNOWN
from kazma.config.keyring import DECISION_KEYS, Keyring
from kazma.config.metrics import failure_count
from kazma.config.store.database import open_database, schema_versions
from tests.approvals_support import TEST_KEY, TEST_KEYRING, ManualClock, RecordingPublisher
from tests.store_backends import Engine, open_store
from tests.test_remembered_approvals import ARGS, CONFIG, HERE, _asks_for_a_card, _remember, remembering

_INSERT = (
    "INSERT INTO approval_rules (id, tool, args_hash, conversation, created_by, created_via, request_id, created_at,"
    " expires_at, seal_key_id, seal) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


async def _approve_once(policy: SafetyPolicy, publisher: RecordingPublisher) -> str:
    """The call approved on its card with plain Approve (no rule); its request id."""
    before = len(publisher.published)
    task = asyncio.create_task(
        policy.check("deploy", ARGS, requested_by="agent:kazma", conversation=HERE, skip_rules=True)
    )
    async with asyncio.timeout(10):
        while len(publisher.published) == before:
            await asyncio.sleep(0.01)
    card = publisher.published[-1]
    pressed = await policy.service.decide_from_button(
        card.button_data(Decision.APPROVE), actor="telegram:111", platform="telegram"
    )
    assert pressed.verdict is PressVerdict.WON
    assert (await task).allowed
    assert card.request_id is not None
    return card.request_id


async def _write_around_kazma(policy: SafetyPolicy, sql: str, params: tuple[object, ...] = ()) -> None:
    conn = policy.service.store.conn
    await conn.execute(sql, params)
    await conn.commit()


async def _refused_with(policy: SafetyPolicy, request_id: str, words: str) -> None:
    [*_, last] = await policy.service.store.events(request_id)
    assert last.event == "rule_refused"
    assert last.detail is not None
    assert words in last.detail, last.detail


async def test_a_rule_written_by_hand_turns_no_plain_approval_into_a_standing_one(tmp_path: Path) -> None:
    clock = ManualClock()
    async with remembering(tmp_path, clock) as (policy, publisher):
        request_id = await _approve_once(policy, publisher)
        request = await policy.service.store.get(request_id)
        assert request is not None
        assert request.decided_by == "telegram:111"
        # Everything the genuine decision can account for: its call, place, person, within max_seconds.
        await _write_around_kazma(
            policy, _INSERT,
            ("rule_byhand", "deploy", request.args_hash, HERE, "telegram:111", "telegram", request_id, clock.now,
             clock.now + 600, None, None),
        )  # fmt: skip
        before = failure_count(FORGED)
        assert await _asks_for_a_card(policy, publisher, ARGS, HERE)
        assert failure_count(FORGED) == before + 1
        await _refused_with(policy, request_id, "carries no seal")


async def test_a_genuine_rules_seal_moved_to_a_later_approval_does_not_verify(tmp_path: Path) -> None:
    # The forger's aim: stretch a rule past its end by pinning it on a later plain Approve of the same call.
    clock = ManualClock()
    async with remembering(tmp_path, clock) as (policy, publisher):
        await _remember(policy, publisher)
        rules = policy.service.rules
        assert rules is not None
        [genuine] = await rules.list()
        assert genuine.seal is not None
        clock.advance(3000)
        later = await _approve_once(policy, publisher)
        clock.advance(700)  # the genuine rule has ended; the later approval is 700 s old
        assert await rules.match("deploy", genuine.args_hash, HERE) is None
        await _write_around_kazma(
            policy, _INSERT,
            ("rule_moved", "deploy", genuine.args_hash, HERE, "telegram:111", "telegram", later, clock.now - 700,
             clock.now + 2900, genuine.seal_key_id, genuine.seal),
        )  # fmt: skip
        before = failure_count(FORGED)
        assert await _asks_for_a_card(policy, publisher, ARGS, HERE)
        assert failure_count(FORGED) == before + 1
        await _refused_with(policy, later, "does not verify")


async def test_a_revoked_rule_set_back_in_force_by_hand_is_refused(tmp_path: Path) -> None:
    async with remembering(tmp_path, ManualClock()) as (policy, publisher):
        await _remember(policy, publisher)
        rules = policy.service.rules
        assert rules is not None
        [rule] = await rules.list()
        assert await policy.service.revoke_rule(rule.id, actor="telegram:111", platform="telegram") is not None
        await _write_around_kazma(policy, "UPDATE approval_rules SET revoked_at = NULL, revoked_by = NULL")
        assert [r.id for r in await rules.list()] == [rule.id]  # in force, as far as its row says
        assert await _asks_for_a_card(policy, publisher, ARGS, HERE)
        await _refused_with(policy, rule.request_id, "revoked by telegram:111")


async def test_a_rule_made_under_an_older_key_still_holds_and_one_under_an_unknown_key_does_not(
    tmp_path: Path,
) -> None:
    async with remembering(tmp_path, ManualClock()) as (policy, publisher):
        await _remember(policy, publisher)
        rules = policy.service.rules
        assert rules is not None
        [rule] = await rules.list()
        assert rule.seal_problem(TEST_KEYRING) is None
        rotated = Keyring.of(DECISION_KEYS, ("k2", "another-decision-key-" + "1" * 32), TEST_KEY)
        assert rule.seal_problem(rotated) is None  # rotation keeps what the older key sealed valid
        assert rule.seal_problem(Keyring.of(DECISION_KEYS, ("k1", "not-the-same-secret-" + "2" * 32))) is not None
        renamed = dataclasses.replace(rule, seal_key_id="k-elsewhere")
        problem = renamed.seal_problem(TEST_KEYRING)
        assert problem is not None
        assert problem.site == KEY_UNKNOWN


NOT_MINE = """
people:
  alice: {telegram: 111}
  bob: {telegram: 222}
approvals:
  approvers: [alice, bob]
  remember: {enabled: true, max_seconds: 3600}
  policies:
    not-mine: {forbid_requester: true}
tools:
  deploy: {policy: not-mine}
"""


async def test_under_forbid_requester_a_rule_never_lets_its_makers_own_work_run(tmp_path: Path) -> None:
    async with remembering(tmp_path, ManualClock(), NOT_MINE) as (policy, publisher):
        # Bob's work asks; Alice (telegram:111) approves it for an hour.
        assert (await _remember(policy, publisher, started_by="telegram:222")).allowed
        # Her own work, the identical call: she could not approve it on a card, so no rule of hers stands for it.
        assert await _asks_for_a_card(policy, publisher, ARGS, HERE, started_by="telegram:111")
        assert await _asks_for_a_card(policy, publisher, ARGS, HERE, started_by="alice")  # named as a person
        # Bob's work again: the rule stands, without a card.
        before = len(publisher.published)
        again = await policy.check(
            "deploy", ARGS, requested_by="agent:kazma", conversation=HERE, started_by="telegram:222"
        )
        assert again.allowed
        assert "remembered approval" in again.reason
        assert len(publisher.published) == before


async def test_without_forbid_requester_the_maker_s_own_work_uses_the_rule(tmp_path: Path) -> None:
    # The control for the test above: the same presses where the policy lets the requester approve.
    async with remembering(tmp_path, ManualClock(), CONFIG) as (policy, publisher):
        assert (await _remember(policy, publisher, started_by="telegram:222")).allowed
        before = len(publisher.published)
        mine = await policy.check(
            "deploy", ARGS, requested_by="agent:kazma", conversation=HERE, started_by="telegram:111"
        )
        assert mine.allowed
        assert len(publisher.published) == before


async def test_a_rules_seal_reads_back_whole_and_binds_every_field(store_engine: Engine) -> None:
    # On both backends: what the row gives back verifies (the times round-trip to the microsecond), and
    # each field the seal binds, changed alone, does not.
    async with open_store(store_engine) as conn:
        made = await RuleStore(conn, clock=lambda: 1_800_000_000.123456).add(
            tool="shell", args_hash="ab" * 32, conversation="slack:C1", created_by="slack:U1", created_via="slack",
            request_id="req_1", seconds=3600, keyring=TEST_KEYRING, definition_hash="de" * 32,
        )  # fmt: skip
        read = await RuleStore(conn, clock=lambda: 1_800_000_001.0).match("shell", "ab" * 32, "slack:C1")
        assert read == made
        assert read.seal_problem(TEST_KEYRING) is None
        changes: dict[str, Any] = {
            "id": "rule_other", "tool": "shell2", "args_hash": "cd" * 32, "conversation": "slack:C2",
            "created_by": "slack:U2", "created_via": "telegram", "request_id": "req_2",
            "created_at": made.created_at + 0.000001, "expires_at": made.expires_at + 1,
            "definition_hash": "df" * 32,
        }  # fmt: skip
        for name, value in changes.items():
            problem = dataclasses.replace(read, **{name: value}).seal_problem(TEST_KEYRING)
            assert problem is not None, name
            assert (problem.site, "does not verify" in problem.detail) == (FORGED, True), name
        # A rule bound to a definition, its digest cleared by hand, would keep only the weaker check by time.
        cleared = dataclasses.replace(read, definition_hash=None).seal_problem(TEST_KEYRING)
        assert cleared is not None
        assert cleared.site == FORGED
        unsealed = await RuleStore(conn).add(
            tool="shell", args_hash="ef" * 32, conversation="slack:C1", created_by="slack:U1", created_via="slack",
            request_id="req_3", seconds=3600,
        )  # fmt: skip
        assert isinstance(unsealed, Rule)
        problem = unsealed.seal_problem(TEST_KEYRING)
        assert problem is not None
        assert "carries no seal" in problem.detail


async def test_a_call_in_no_chat_is_never_remembered(tmp_path: Path) -> None:
    # A swarm worker's calls are in "swarm", shared by every task and whoever asked for it: a rule made there
    # would let another task's identical call run unseen, and its use could be said nowhere.
    async with remembering(tmp_path, ManualClock()) as (policy, publisher):
        task = asyncio.create_task(policy.check("deploy", ARGS, requested_by="agent:builder", conversation="swarm"))
        async with asyncio.timeout(10):
            while not publisher.published:
                await asyncio.sleep(0.01)
        card = publisher.published[-1]
        assert card.remember_seconds is None  # no "Approve for" button
        pressed = await policy.service.decide_from_button(card.remember_data, actor="telegram:111", platform="telegram")
        assert pressed.verdict is PressVerdict.REFUSED
        assert "in a chat" in pressed.message
        assert await policy.service.rules.list() == []  # type: ignore[union-attr]
        approved = await policy.service.decide_from_button(
            card.button_data(Decision.APPROVE), actor="telegram:111", platform="telegram"
        )
        assert approved.verdict is PressVerdict.WON
        assert (await task).allowed


async def test_a_sealed_rule_still_stands_only_for_the_approval_it_names(tmp_path: Path) -> None:
    # Past the seal, the rule must agree with its sealed approval: these rules are sealed with the key itself
    # (what a process holding the key but no decision could make), one at a time, each refused for its reason.
    clock = ManualClock()
    both = CONFIG.replace('["telegram:111"]', '["telegram:111", "telegram:222"]')  # 222: an approver, not the decider
    async with remembering(tmp_path, clock, both) as (policy, publisher):
        rules = policy.service.rules
        assert rules is not None
        approved = await _approve_once(policy, publisher)
        request = await policy.service.store.get(approved)
        assert request is not None
        denied_task = asyncio.create_task(
            policy.check("deploy", ARGS, requested_by="agent:kazma", conversation=HERE, skip_rules=True)
        )
        async with asyncio.timeout(10):
            while publisher.published[-1].request_id == approved:
                await asyncio.sleep(0.01)
        denied = publisher.published[-1].request_id
        assert denied is not None
        await policy.service.decide_from_button(
            publisher.published[-1].button_data(Decision.DENY), actor="telegram:111", platform="telegram"
        )
        assert not (await denied_task).allowed

        async def refused(made_by: str, request_id: str, words: str, *, site: str = FORGED) -> None:
            rule = await rules.add(
                tool="deploy", args_hash=request.args_hash, conversation=HERE, created_by=made_by,
                created_via="telegram", request_id=request_id, seconds=3600, keyring=TEST_KEYRING,
            )  # fmt: skip
            assert rule.seal_problem(TEST_KEYRING) is None
            before = failure_count(site)
            assert await _asks_for_a_card(policy, publisher, ARGS, HERE)
            assert failure_count(site) == before + 1
            [*_, last] = await policy.service.store.events(request_id)
            assert (last.event, words in str(last.detail)) == ("rule_refused", True), last.detail
            assert await rules.revoke(rule.id, actor="test")

        await refused("telegram:111", "req_nowhere", "names no request")
        await refused("telegram:111", denied, "does not hold")
        await refused("telegram:222", approved, "another call, place or person")
        clock.advance(3601)  # the approval is older than max_seconds; a rule made now would outlive it
        await refused("telegram:111", approved, "outlives approvals.remember.max_seconds")


async def test_a_rule_sealed_with_a_key_not_held_here_is_counted_as_such(tmp_path: Path) -> None:
    async with remembering(tmp_path, ManualClock()) as (policy, publisher):
        rules = policy.service.rules
        assert rules is not None
        approved = await _approve_once(policy, publisher)
        request = await policy.service.store.get(approved)
        assert request is not None
        elsewhere = Keyring.of(DECISION_KEYS, ("k9", "a-key-this-process-never-held-" + "3" * 32))
        await rules.add(
            tool="deploy", args_hash=request.args_hash, conversation=HERE, created_by="telegram:111",
            created_via="telegram", request_id=approved, seconds=3600, keyring=elsewhere,
        )  # fmt: skip
        unknown, forged = failure_count(KEY_UNKNOWN), failure_count(FORGED)
        assert await _asks_for_a_card(policy, publisher, ARGS, HERE)
        assert (failure_count(KEY_UNKNOWN), failure_count(FORGED)) == (unknown + 1, forged)
        await _refused_with(policy, approved, "'k9', which is not in the decision keyring here")


async def test_a_rule_stands_only_while_its_maker_may_still_approve_the_tool(tmp_path: Path) -> None:
    # An operator narrows who may approve deploy (and restarts): a rule its old approver made an hour ago must not
    # go on letting the call run for the rest of its time.
    clock = ManualClock()
    async with remembering(tmp_path, clock) as (policy, publisher):
        await _remember(policy, publisher)
    narrowed = CONFIG.replace('approvers: ["telegram:111"]', 'approvers: ["telegram:111"]\n  policies: {ops: '
                              '{approvers: ["telegram:222"]}}') + "tools: {deploy: {policy: ops}}\n"  # fmt: skip
    async with remembering(tmp_path, clock, narrowed) as (policy, publisher):
        assert policy.service.config.policy_name_for("deploy") == "ops"
        rules = policy.service.rules
        assert rules is not None
        assert len(await rules.list()) == 1  # still in force on its row
        assert await _asks_for_a_card(policy, publisher, ARGS, HERE, decider="telegram:222")
    async with remembering(tmp_path, clock) as (policy, publisher):  # the control: as it was, it stands
        async with asyncio.timeout(10):
            verdict = await policy.check("deploy", ARGS, requested_by="agent:kazma", conversation=HERE)
        assert verdict.allowed
        assert not publisher.published


async def test_a_rule_whose_approval_lost_its_decided_audit_row_is_refused(tmp_path: Path) -> None:
    async with remembering(tmp_path, ManualClock()) as (policy, publisher):
        await _remember(policy, publisher)
        rules = policy.service.rules
        assert rules is not None
        [rule] = await rules.list()
        # the file's owner may take the append-only trigger away, and the decided row with it
        await _write_around_kazma(policy, "DROP TRIGGER approval_events_append_only_delete")
        await _write_around_kazma(
            policy, "DELETE FROM approval_events WHERE request_id = ? AND event = 'decided'", (rule.request_id,)
        )
        before = failure_count(FORGED)
        assert await _asks_for_a_card(policy, publisher, ARGS, HERE)
        assert failure_count(FORGED) == before + 1
        await _refused_with(policy, rule.request_id, "has no decided audit row")


async def test_an_approver_removed_from_the_configuration_is_no_forgery(tmp_path: Path) -> None:
    # The rule's maker is taken off approvals.approvers (and Kazma restarted): the call gets a card, quietly; a
    # configuration change is not counted, audited or logged as a forged rule.
    clock = ManualClock()
    async with remembering(tmp_path, clock) as (policy, publisher):
        await _remember(policy, publisher)
    async with remembering(tmp_path, clock, CONFIG.replace("telegram:111", "telegram:222")) as (policy, publisher):
        rules = policy.service.rules
        assert rules is not None
        [rule] = await rules.list()
        before = failure_count(FORGED)
        assert await _asks_for_a_card(policy, publisher, ARGS, HERE, decider="telegram:222")
        assert failure_count(FORGED) == before
        assert "rule_refused" not in [e.event for e in await policy.service.store.events(rule.request_id)]


_REFUSE_EVENT = (
    "CREATE TRIGGER refuse_{event} BEFORE INSERT ON approval_events WHEN NEW.event = '{event}'"
    " BEGIN SELECT RAISE(ABORT, 'the audit cannot take {event} (test)'); END"
)


async def test_a_revocation_the_audit_cannot_record_revokes_nothing(tmp_path: Path) -> None:
    # The rule check consults the audit's rule_revoked: a row revoked without it could be set back in force by
    # hand and pass. Both are one transaction, so a failed audit write leaves the rule as it was, and says so.
    async with remembering(tmp_path, ManualClock()) as (policy, publisher):
        await _remember(policy, publisher)
        rules = policy.service.rules
        assert rules is not None
        [rule] = await rules.list()
        await _write_around_kazma(policy, _REFUSE_EVENT.format(event="rule_revoked"))
        with pytest.raises(sqlite3.IntegrityError, match="the audit cannot take rule_revoked"):
            await policy.service.revoke_rule(rule.id, actor="telegram:111", platform="telegram")
        assert [r.id for r in await rules.list()] == [rule.id]  # still in force: nothing half done
        assert "rule_revoked" not in [e.event for e in await policy.service.store.events(rule.request_id)]
        await _write_around_kazma(policy, "DROP TRIGGER refuse_rule_revoked")
        assert await policy.service.revoke_rule(rule.id, actor="telegram:111", platform="telegram") is not None
        assert await rules.list() == []
        assert "rule_revoked" in [e.event for e in await policy.service.store.events(rule.request_id)]


async def test_a_rule_the_audit_cannot_record_is_not_made_and_the_approval_stands(tmp_path: Path) -> None:
    async with remembering(tmp_path, ManualClock()) as (policy, publisher):
        await _write_around_kazma(policy, _REFUSE_EVENT.format(event="rule_created"))
        before = failure_count("approval_rule")
        verdict = await _remember(policy, publisher)  # the press won: "Approve for 1 h" approved this call
        assert verdict.allowed
        assert failure_count("approval_rule") == before + 1
        rules = policy.service.rules
        assert rules is not None
        assert await rules.list(active_only=False) == []  # no rule the audit does not show
        await _write_around_kazma(policy, "DROP TRIGGER refuse_rule_created")
        assert await _asks_for_a_card(policy, publisher, ARGS, HERE)  # the next identical call: a card


async def test_a_shorter_max_seconds_ends_older_rules_and_is_no_forgery(tmp_path: Path) -> None:
    # The team lowers approvals.remember.max_seconds (and restarts): a rule made under the longer one no longer
    # stands once older than the new limit, quietly; a configuration change is not counted, audited or logged as a
    # forged rule (an operator told "forged" would look for an attacker who is not there).
    clock = ManualClock()
    async with remembering(tmp_path, clock) as (policy, publisher):
        await _remember(policy, publisher)
    clock.advance(700)
    shorter = CONFIG.replace("max_seconds: 3600", "max_seconds: 600")
    async with remembering(tmp_path, clock, shorter) as (policy, publisher):
        rules = policy.service.rules
        assert rules is not None
        [rule] = await rules.list()
        before = failure_count(FORGED)
        assert await _asks_for_a_card(policy, publisher, ARGS, HERE)
        assert failure_count(FORGED) == before
        assert "rule_refused" not in [e.event for e in await policy.service.store.events(rule.request_id)]


async def test_a_store_migrated_from_before_definitions_keeps_its_rules_as_they_were(tmp_path: Path) -> None:
    # A store whose rules predate the definition digest (approvals 19, approval_rules 2) is migrated at start: its
    # rows gain an empty digest, their seals still verify as they were made, and they keep the check by time.
    path = tmp_path / "kazma.db"
    old = await open_database(path, busy_timeout_ms=5000, migrations=[*MIGRATIONS[:-1], *RULES[:-1]])
    try:
        assert await schema_versions(old) == {"approvals": 19, "approval_rules": 2}
        made = RuleStore(old, clock=lambda: 1_800_000_000.0).made(
            tool="deploy", args_hash="ab" * 32, conversation=HERE, created_by="telegram:111", created_via="telegram",
            request_id="req_1", seconds=3600, keyring=TEST_KEYRING,
        )  # fmt: skip
        await old.execute(_INSERT, (*made.bound, made.seal_key_id, made.seal))
        await old.commit()
    finally:
        await old.close()
    new = await open_database(path, busy_timeout_ms=5000, migrations=[*MIGRATIONS, *RULES])
    try:
        assert await schema_versions(new) == {"approvals": 20, "approval_rules": 3}
        [read] = await RuleStore(new, clock=lambda: 1_800_000_001.0).list()
        assert read == made
        assert read.definition_hash is None
        assert read.seal_problem(TEST_KEYRING) is None
        columns = [row[1] for row in await new.execute_fetchall("PRAGMA table_info(approval_requests)")]
        assert "definition_hash" in columns
    finally:
        await new.close()
