"""Remembered approvals: "Approve for 1 h" lets exactly the same call run again in the same conversation only."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from kazma.adapters.card_layout import ButtonKind, view_of
from kazma.approvals import ApprovalService, ApprovalStore, Decision, PressVerdict, SafetyPolicy
from kazma.approvals.policy import PolicyVerdict
from kazma.approvals.rules import RuleStore, rule_standing, rule_states
from kazma.bot.cli.cli_identity import system_login
from kazma.bot.store import all_migrations
from kazma.config import load_config_text
from kazma.config.store.database import open_database
from kazma.engine.model import ScriptStep
from tests.approvals_support import TEST_KEYRING, ManualClock, RecordingPublisher
from tests.child_env import child_env
from tests.mcp_support import (
    TG_CHAT,
    Seen,
    call,
    calls_logged,
    cards,
    kazma_with_tracker,
    press,
    tracker_http,
    tracker_log,
)
from tests.store_backends import Engine, open_store

CONFIG = """
approvals:
  approvers: ["telegram:111"]
  remember: {enabled: true, max_seconds: 3600}
"""
HERE = "telegram:-1001"
ARGS = {"env": "prod", "version": 42}


@asynccontextmanager
async def remembering(
    tmp: Path, clock: ManualClock, config: str = CONFIG
) -> AsyncIterator[tuple[SafetyPolicy, RecordingPublisher]]:
    conn = await open_database(tmp / "kazma.db", busy_timeout_ms=5000, migrations=all_migrations())
    publisher = RecordingPublisher()
    service = ApprovalService(
        ApprovalStore(conn, clock=clock, keyring=TEST_KEYRING),
        load_config_text(config, environ={}).config,
        publisher=publisher,
        clock=clock,
        poll_interval=0.02,
        rules=RuleStore(conn, clock=clock),
    )
    try:
        yield SafetyPolicy(service), publisher
    finally:
        await conn.close()


async def _asks_for_a_card(
    policy: SafetyPolicy, publisher: RecordingPublisher, args: Any, where: str, *, started_by: str | None = None,
    decider: str = "telegram:111",
) -> bool:  # fmt: skip
    """Whether this call gets a card (then it is denied, so nothing is left pending)."""
    before = len(publisher.published)
    task = asyncio.create_task(
        policy.check("deploy", args, requested_by="agent:kazma", conversation=where, started_by=started_by)
    )
    async with asyncio.timeout(10):
        while len(publisher.published) == before and not task.done():
            await asyncio.sleep(0.01)
    if task.done():
        return False
    card = publisher.published[-1]
    await policy.service.decide_from_button(card.button_data(Decision.DENY), actor=decider, platform="telegram")
    async with asyncio.timeout(10):
        verdict = await task
    assert not verdict.allowed
    return True


async def _remember(
    policy: SafetyPolicy, publisher: RecordingPublisher, *, started_by: str | None = None
) -> PolicyVerdict:
    task = asyncio.create_task(
        policy.check("deploy", ARGS, requested_by="agent:kazma", conversation=HERE, started_by=started_by)
    )
    async with asyncio.timeout(10):
        while not publisher.published:
            await asyncio.sleep(0.01)
    card = publisher.published[-1]
    assert card.remember_seconds == 3600
    result = await policy.service.decide_from_button(card.remember_data, actor="telegram:111", platform="telegram")
    assert result.verdict is PressVerdict.WON
    return await task


async def test_the_identical_call_runs_again_without_a_card_and_nothing_else_does(tmp_path: Path) -> None:
    clock = ManualClock()
    async with remembering(tmp_path, clock) as (policy, publisher):
        first = await _remember(policy, publisher)
        assert first.allowed
        [rule] = await policy.service.rules.list()  # type: ignore[union-attr]
        assert rule.created_by == "telegram:111"
        again = await policy.check("deploy", dict(ARGS), requested_by="agent:kazma", conversation=HERE)
        assert again.allowed
        assert rule.id in again.reason
        assert "telegram:111" in again.reason
        assert len(publisher.published) == 1  # no second card
        events = [e.event for e in await policy.service.store.events(rule.request_id)]
        assert "rule_created" in events
        assert "rule_used" in events
        # one byte different: a card
        assert await _asks_for_a_card(policy, publisher, {"env": "prod", "version": 43}, HERE)
        # attack: the same call in another conversation is not covered
        assert await _asks_for_a_card(policy, publisher, ARGS, "telegram:-1002")


async def test_after_expiry_the_call_gets_a_card(tmp_path: Path) -> None:
    clock = ManualClock()
    async with remembering(tmp_path, clock) as (policy, publisher):
        await _remember(policy, publisher)
        clock.advance(3601)
        assert await _asks_for_a_card(policy, publisher, ARGS, HERE)


async def test_after_revoke_the_call_gets_a_card(tmp_path: Path) -> None:
    async with remembering(tmp_path, ManualClock()) as (policy, publisher):
        await _remember(policy, publisher)
        rules = policy.service.rules
        assert rules is not None
        [rule] = await rules.list()
        assert await rules.revoke(rule.id, actor="cli:ops")
        assert await _asks_for_a_card(policy, publisher, ARGS, HERE)


async def test_a_warned_or_cut_card_has_no_such_button_and_refuses_the_press(tmp_path: Path) -> None:
    clock = ManualClock()
    async with remembering(tmp_path, clock) as (policy, publisher):
        task = asyncio.create_task(
            policy.check("deploy", {"env": "pro\u200bd"}, requested_by="agent:kazma", conversation=HERE)
        )
        async with asyncio.timeout(10):
            while not publisher.published:
                await asyncio.sleep(0.01)
        warned = publisher.published[-1]
        assert warned.has_warnings
        assert warned.remember_seconds is None
        assert ButtonKind.REMEMBER not in {b.kind for b in view_of(warned).buttons}
        forged = await policy.service.decide_from_button(
            warned.remember_data, actor="telegram:111", platform="telegram"
        )
        assert forged.verdict is PressVerdict.REFUSED
        assert await policy.service.rules.list() == []  # type: ignore[union-attr]
        await _stop(task)
        plain = await _remember_card(policy, publisher, {"env": "prod"})
        assert ButtonKind.REMEMBER in {b.kind for b in view_of(plain).buttons}
        long = await _remember_card(policy, publisher, {"script": "x" * 5000})
        assert ButtonKind.REMEMBER not in {b.kind for b in view_of(long, limit=100).buttons}


async def _remember_card(policy: SafetyPolicy, publisher: RecordingPublisher, args: dict[str, Any]) -> Any:
    before = len(publisher.published)
    task = asyncio.create_task(policy.check("deploy", args, requested_by="agent:kazma", conversation=HERE))
    async with asyncio.timeout(10):
        while len(publisher.published) == before:
            await asyncio.sleep(0.01)
    await _stop(task)
    return publisher.published[-1]


async def _stop(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def the_same_issue_filed_twice() -> tuple[Seen, Seen, list[ScriptStep]]:
    """The model's script: create_issue with the same arguments in two turns, what each turn saw kept apart."""
    first, second = Seen(), Seen()
    issue = {"title": "Bug", "body": "b"}
    steps: list[ScriptStep] = [
        call("tracker__create_issue", issue),
        first.answer,
        call("tracker__create_issue", issue),
        second.answer,
    ]
    return first, second, steps


async def test_on_telegram_a_remembered_mcp_call_runs_again_and_says_so(tmp_path: Path) -> None:
    first, second, steps = the_same_issue_filed_twice()
    async with kazma_with_tracker(tmp_path, steps, remember=True) as (_app, telegram, log):
        telegram.push_message(TG_CHAT, 42, "file it", username="alice")
        await telegram.wait_until(lambda: bool(cards(telegram)), timeout=20)
        await press(telegram, "r")
        await telegram.wait_until(lambda: bool(first.tool_messages), timeout=20)
        telegram.push_message(TG_CHAT, 42, "file it again", username="alice")
        await telegram.wait_until(lambda: bool(second.tool_messages), timeout=20)
        assert len(cards(telegram)) == 1
        assert len(calls_logged(log)) == 2
        texts = [m.text for m in telegram.bot_messages(TG_CHAT)]
        assert any("remembered approval rule_" in t and "telegram:111" in t for t in texts)


async def test_rules_cli_lists_and_revokes(tmp_path: Path) -> None:
    from kazma.bot.keys import load_decision_keyring
    from kazma.bot.store import open_store

    config_file = tmp_path / "kazma.yaml"
    config_file.write_text(f"store: {{path: '{tmp_path / 'state' / 'kazma.db'}'}}\n", encoding="utf-8")
    config = load_config_text(config_file.read_text(), environ={}).config
    ring = load_decision_keyring(config, environ={})  # what `kazma run` makes at its first start
    conn = await open_store(config)
    try:
        rule = await RuleStore(conn).add(
            tool="deploy", args_hash="ab" * 32, conversation=HERE, created_by="telegram:111",
            created_via="telegram", request_id="r" * 22, seconds=3600,
        )  # fmt: skip
        sealed = await RuleStore(conn).add(
            tool="deploy", args_hash="cd" * 32, conversation=HERE, created_by="telegram:111",
            created_via="telegram", request_id="s" * 22, seconds=3600, keyring=ring,
        )  # fmt: skip
    finally:
        await conn.close()

    async def kazma(*args: str) -> tuple[int, str]:
        # a child process: the CLI configures logging for its whole process
        env = child_env(base={k: v for k, v in os.environ.items() if not k.startswith("KAZMA_")})
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kazma.bot.cli", "-c", str(config_file), "approvals", "rules", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode is not None
        return proc.returncode, out.decode()

    _, listed = await kazma("list")
    lines = {line.split()[0]: line for line in listed.splitlines() if line.startswith("rule_")}
    assert "telegram:111" in lines[rule.id]
    assert "REFUSED: it carries no seal" in lines[rule.id]  # a row that lets nothing run says so
    assert "REFUSED" not in lines[sealed.id]

    async def around_kazma(sql: str) -> None:
        conn = await open_store(config)
        try:
            await conn.execute(sql)
            await conn.commit()
        finally:
            await conn.close()

    # The row and its rule_revoked are one transaction: when the audit cannot take the event, nothing changes.
    await around_kazma(
        "CREATE TRIGGER refuse_revoked BEFORE INSERT ON approval_events WHEN NEW.event = 'rule_revoked'"
        " BEGIN SELECT RAISE(ABORT, 'the audit is full (test)'); END"
    )
    code, failed = await kazma("revoke", rule.id)
    assert code == 1
    assert f"could not revoke {rule.id}" in failed
    assert "nothing changed" in failed
    assert "Traceback" not in failed
    assert rule.id in (await kazma("list"))[1]
    await around_kazma("DROP TRIGGER refuse_revoked")
    code, revoked = await kazma("revoke", rule.id)
    assert code == 0, revoked
    conn = await open_store(config)
    try:
        events = await ApprovalStore(conn).events("r" * 22, event="rule_revoked")
    finally:
        await conn.close()
    assert [(e.actor, e.platform, e.detail) for e in events] == [(f"cli:{system_login()}", "cli", rule.id)]
    _, after = await kazma("list")
    assert rule.id not in after
    again, _ = await kazma("revoke", rule.id)
    assert again == 1


async def test_a_remembered_mcp_call_gets_a_card_again_once_its_tool_is_redefined(tmp_path: Path) -> None:
    # The rule was made on a card of create_issue as its server first listed it; the server then listed it again
    # with another description and a new argument defaulting to public. The same arguments now run another tool:
    # the person never saw it, so the rule must not let it run unasked.
    first, second, steps = the_same_issue_filed_twice()
    async with kazma_with_tracker(tmp_path, steps, remember=True) as (app, telegram, log):
        assert app.mcp is not None
        connection = app.mcp.connections["tracker"]
        telegram.push_message(TG_CHAT, 42, "file it", username="alice")
        await telegram.wait_until(lambda: bool(cards(telegram)), timeout=20)
        await press(telegram, "r")
        await telegram.wait_until(lambda: bool(first.tool_messages), timeout=20)
        assert len(calls_logged(log)) == 1
        before = connection.tools["create_issue"]
        assert (await connection.call("redefine", {})).ok
        await telegram.wait_until(lambda: connection.tools["create_issue"] != before, timeout=20)
        telegram.push_message(TG_CHAT, 42, "file it again", username="alice")
        await telegram.wait_until(lambda: len(cards(telegram)) == 2 or bool(second.tool_messages), timeout=20)
        assert len(cards(telegram)) == 2  # asked again: the rule stood for the tool as it was
        assert len(calls_logged(log)) == 1  # nothing ran unasked
        await press(telegram, "d")
        await telegram.wait_until(lambda: bool(second.tool_messages), timeout=20)
        assert "Denied" in second.tool_messages[0]
        assert len(calls_logged(log)) == 1


async def test_a_remembered_mcp_call_runs_without_a_card_after_a_restart(tmp_path: Path) -> None:
    # The rule was made for create_issue as its server lists it; Kazma restarts on the same store and the server
    # lists the very same tool again. The rule stood for that definition, so it still stands: a restart is no
    # reason to ask the person again.
    first, again = Seen(), Seen()
    issue = {"title": "Bug", "body": "b"}
    steps: list[ScriptStep] = [call("tracker__create_issue", issue), first.answer]
    async with kazma_with_tracker(tmp_path, steps, remember=True) as (_app, telegram, log):
        telegram.push_message(TG_CHAT, 42, "file it", username="alice")
        await telegram.wait_until(lambda: bool(cards(telegram)), timeout=20)
        assert "Definition SHA-256: " in cards(telegram)[0]  # which definition the person approves
        await press(telegram, "r")
        await telegram.wait_until(lambda: bool(first.tool_messages), timeout=20)
        assert len(calls_logged(log)) == 1
    steps = [call("tracker__create_issue", issue), again.answer]
    async with kazma_with_tracker(tmp_path, steps, remember=True) as (_app, telegram, log):
        telegram.push_message(TG_CHAT, 42, "file it again", username="alice")
        await telegram.wait_until(lambda: bool(cards(telegram)) or bool(again.tool_messages), timeout=20)
        assert not cards(telegram)  # no card: the rule stood for this very definition
        assert len(calls_logged(log)) == 2
        texts = [m.text for m in telegram.bot_messages(TG_CHAT)]
        assert any("remembered approval rule_" in t for t in texts)


async def test_a_remembered_mcp_call_gets_a_card_after_a_restart_once_its_tool_is_redefined(tmp_path: Path) -> None:
    # The rule was made for create_issue as first listed; the server (which outlives Kazma) then redefined it, and
    # Kazma restarted: the tool it lists now is not the one the person approved, so the rule does not stand (a
    # restart must not carry an approval over to another definition).
    first, again = Seen(), Seen()
    issue = {"title": "Bug", "body": "b"}
    log = tracker_log(tmp_path)
    async with tracker_http(log) as url:
        steps: list[ScriptStep] = [call("tracker__create_issue", issue), first.answer]
        async with kazma_with_tracker(tmp_path, steps, url=url, remember=True) as (app, telegram, _):
            assert app.mcp is not None
            connection = app.mcp.connections["tracker"]
            telegram.push_message(TG_CHAT, 42, "file it", username="alice")
            await telegram.wait_until(lambda: bool(cards(telegram)), timeout=20)
            await press(telegram, "r")
            await telegram.wait_until(lambda: bool(first.tool_messages), timeout=20)
            assert len(calls_logged(log)) == 1
            assert (await connection.call("redefine", {})).ok
        steps = [call("tracker__create_issue", issue), again.answer]
        async with kazma_with_tracker(tmp_path, steps, url=url, remember=True) as (app, telegram, _):
            telegram.push_message(TG_CHAT, 42, "file it again", username="alice")
            await telegram.wait_until(lambda: bool(cards(telegram)) or bool(again.tool_messages), timeout=20)
            assert len(cards(telegram)) == 1  # asked: the rule stood for the tool as it was
            assert len(calls_logged(log)) == 1  # nothing ran unasked
            await press(telegram, "d")
            await telegram.wait_until(lambda: bool(again.tool_messages), timeout=20)
            assert "Denied" in again.tool_messages[0]
            assert len(calls_logged(log)) == 1


@asynccontextmanager
async def remembering_on(engine: Engine, clock: ManualClock) -> AsyncIterator[tuple[SafetyPolicy, RecordingPublisher]]:
    """:func:`remembering` on either engine's store (every component migrated): entered again, a restart."""
    async with open_store(engine) as conn:
        publisher = RecordingPublisher()
        service = ApprovalService(
            ApprovalStore(conn, clock=clock, keyring=TEST_KEYRING), load_config_text(CONFIG, environ={}).config,
            publisher=publisher, clock=clock, poll_interval=0.02, rules=RuleStore(conn, clock=clock),
        )  # fmt: skip
        yield SafetyPolicy(service), publisher


async def _checked(
    policy: SafetyPolicy, publisher: RecordingPublisher, definition: str, since: float
) -> tuple[asyncio.Task[Any], bool]:
    """The call of the tool defined as ``definition`` (first seen here at ``since``), checked by the policy, and
    whether it got a card (False: the check ended without one)."""
    before = len(publisher.published)
    task = asyncio.create_task(
        policy.check(
            "deploy",
            ARGS,
            requested_by="agent:kazma",
            conversation=HERE,
            definition_hash=definition,
            defined_since=since,
        )
    )
    async with asyncio.timeout(10):
        while len(publisher.published) == before and not task.done():
            await asyncio.sleep(0.01)
    return task, len(publisher.published) > before


async def _gets_a_card(policy: SafetyPolicy, publisher: RecordingPublisher, definition: str, since: float) -> bool:
    """Whether the call of a tool defined as ``definition`` (first seen here at ``since``) gets a card."""
    task, carded = await _checked(policy, publisher, definition, since)
    if not carded:
        assert (await task).allowed
        return False
    card = publisher.published[-1]
    await policy.service.decide_from_button(card.button_data(Decision.DENY), actor="telegram:111", platform="telegram")
    async with asyncio.timeout(10):
        assert not (await task).allowed
    return True


async def test_a_remembered_approval_stands_across_a_restart_for_its_definition_only(store_engine: Engine) -> None:
    # On SQLite and on PostgreSQL (the migrations applied there): the rule is bound to the digest of the tool's
    # definition its card was opened for, not to when this process first saw the tool.
    clock = ManualClock()
    approved, other = "a" * 64, "b" * 64
    async with remembering_on(store_engine, clock) as (policy, publisher):
        task = asyncio.create_task(
            policy.check(
                "deploy",
                ARGS,
                requested_by="agent:kazma",
                conversation=HERE,
                definition_hash=approved,
                defined_since=clock.now,
            )
        )
        async with asyncio.timeout(10):
            while not publisher.published:
                await asyncio.sleep(0.01)
        card = publisher.published[-1]
        assert card.about == (f"Definition SHA-256: {approved[:16]}…",)  # what the person approves
        pressed = await policy.service.decide_from_button(card.remember_data, actor="telegram:111", platform="telegram")
        assert pressed.verdict is PressVerdict.WON
        assert (await task).allowed
        [rule] = await policy.service.rules.list()  # type: ignore[union-attr]
        assert rule.definition_hash == approved
        assert rule.seal_problem(TEST_KEYRING) is None
        events = await policy.service.store.events(rule.request_id)
        assert [e.detail for e in events if e.event == "opened"] == [f"tool=deploy definition={approved}"]
        assert [e.detail for e in events if e.event == "rule_created"] == [
            f"{rule.id} until {rule.expires_at:.0f} for tool definition {approved}"
        ]
    clock.advance(60)
    async with remembering_on(store_engine, clock) as (policy, publisher):  # a restart: the tool first seen now
        assert not await _gets_a_card(policy, publisher, approved, clock.now)
        used = await policy.service.store.events(rule.request_id, event="rule_used")
        assert used
        assert approved[:12] in str(used[-1].detail)
        assert await _gets_a_card(policy, publisher, other, clock.now - 3600)  # redefined: asked again
        assert not await _gets_a_card(policy, publisher, approved, clock.now)  # as approved again: it stands


async def test_a_rule_made_before_definitions_were_recorded_keeps_the_check_by_time(tmp_path: Path) -> None:
    clock = ManualClock()
    async with remembering(tmp_path, clock) as (policy, publisher):
        await _remember(policy, publisher)  # no definition recorded: as a rule made before the migration
        [rule] = await policy.service.rules.list()  # type: ignore[union-attr]
        assert rule.definition_hash is None
        assert not await _gets_a_card(policy, publisher, "a" * 64, clock.now - 1)  # seen before its card: stands
        assert await _gets_a_card(policy, publisher, "a" * 64, clock.now + 1)  # (re)defined since: a card


async def test_a_remembered_mcp_call_gets_a_card_after_a_restart_onto_another_server(tmp_path: Path) -> None:
    # Two servers list create_issue word for word; the operator points "tracker" from the first to the second and
    # restarts. The rule was approved for a tool served from the first: the same name, description and schema
    # elsewhere is another tool, so the call is put to a person again.
    first, again = Seen(), Seen()
    issue = {"title": "Bug", "body": "b"}
    log = tracker_log(tmp_path)
    async with tracker_http(log) as old_url, tracker_http(log) as new_url:
        steps: list[ScriptStep] = [call("tracker__create_issue", issue), first.answer]
        async with kazma_with_tracker(tmp_path, steps, url=old_url, remember=True) as (_app, telegram, _):
            telegram.push_message(TG_CHAT, 42, "file it", username="alice")
            await telegram.wait_until(lambda: bool(cards(telegram)), timeout=20)
            await press(telegram, "r")
            await telegram.wait_until(lambda: bool(first.tool_messages), timeout=20)
            assert len(calls_logged(log)) == 1
        steps = [call("tracker__create_issue", issue), again.answer]
        async with kazma_with_tracker(tmp_path, steps, url=new_url, remember=True) as (_app, telegram, _):
            telegram.push_message(TG_CHAT, 42, "file it again", username="alice")
            await telegram.wait_until(lambda: bool(cards(telegram)) or bool(again.tool_messages), timeout=20)
            assert len(cards(telegram)) == 1  # asked: the rule stood for the tool of the first server
            assert len(calls_logged(log)) == 1
            await press(telegram, "d")
            await telegram.wait_until(lambda: bool(again.tool_messages), timeout=20)
            assert len(calls_logged(log)) == 1


async def _remember_for(policy: SafetyPolicy, publisher: RecordingPublisher, definition: str, since: float) -> None:
    """The call of the tool defined as ``definition`` gets a card, and "Approve for …" is pressed on it."""
    task, carded = await _checked(policy, publisher, definition, since)
    assert carded
    card = publisher.published[-1]
    pressed = await policy.service.decide_from_button(card.remember_data, actor="telegram:111", platform="telegram")
    assert pressed.verdict is PressVerdict.WON
    assert (await task).allowed


async def test_a_rule_for_one_definition_does_not_hide_the_rule_for_another(tmp_path: Path) -> None:
    # Replicas whose servers list two versions of the tool (a rolling upgrade): a rule was approved for each. The
    # newer rule must not shadow the older one: a call of the tool as first defined still runs under its own rule.
    clock = ManualClock()
    first, second = "a" * 64, "b" * 64
    async with remembering(tmp_path, clock) as (policy, publisher):
        await _remember_for(policy, publisher, first, clock.now)
        clock.advance(60)
        await _remember_for(policy, publisher, second, clock.now)
        assert len(await policy.service.rules.list()) == 2  # type: ignore[union-attr]
        assert not await _gets_a_card(policy, publisher, first, clock.now)
        assert not await _gets_a_card(policy, publisher, second, clock.now)
        assert await _gets_a_card(policy, publisher, "c" * 64, clock.now)


async def test_a_request_reads_back_with_its_definition_and_a_rule_for_another_is_refused(store_engine: Engine) -> None:
    # The definition a request was opened for comes back with its row (the rule check on the dangerous-call path
    # reads that row once, where it used to read the definition again), on SQLite and on PostgreSQL. A rule whose
    # sealed definition is not the one its request was opened for is still refused as no rule Kazma made.
    clock = ManualClock()
    approved = "a" * 64
    async with remembering_on(store_engine, clock) as (policy, publisher):
        await _remember_for(policy, publisher, approved, clock.now)
        [rule] = await policy.service.rules.list()  # type: ignore[union-attr]
        request = await policy.service.store.get(rule.request_id)
        assert request is not None
        assert request.definition_hash == approved
        assert not await _gets_a_card(policy, publisher, approved, clock.now)
        await policy.service.store.write(
            lambda tx: tx.run(
                "UPDATE approval_requests SET definition_hash = ? WHERE id = ?", ("b" * 64, rule.request_id)
            )
        )
        assert await _gets_a_card(policy, publisher, approved, clock.now)
        [*_, refused] = await policy.service.store.events(rule.request_id, event="rule_refused")
        assert "was for another definition of deploy" in str(refused.detail)


def _rules_listed(tmp_path: Path, remember: str, *args: str) -> dict[str, str]:
    """``kazma approvals rules list`` on the store at ``tmp_path`` under ``approvals.remember: {remember}``: each
    rule's line by its id."""
    from click.testing import CliRunner

    from kazma.bot.cli import main
    from tests.audit_support import KEY_ENV

    config = tmp_path / "kazma.yaml"
    config.write_text(
        f"store: {{path: '{tmp_path / 'kazma.db'}'}}\n"
        f"approvals:\n  approvers: ['telegram:111']\n  remember: {remember}\n",
        encoding="utf-8",
    )
    result = CliRunner().invoke(main, ["-c", str(config), "approvals", "rules", "list", *args], env=KEY_ENV)
    assert result.exit_code == 0, result.output
    return {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith("rule_")}


def test_rules_list_shows_each_definition_and_says_which_rules_a_lowered_max_seconds_ended(tmp_path: Path) -> None:
    # Two rules for the same call of an MCP tool in two definitions: one approved 3000 s ago, one 50 s ago. The
    # team lowers max_seconds to 600: the older no longer lets anything run (the service ends it quietly), so the
    # listing must not call it active; each line shows the definition digest its rule is bound to, as the card did.
    clock = ManualClock(time.time() - 3000)
    old, new = "a" * 64, "b" * 64

    async def made() -> None:
        async with remembering(tmp_path, clock) as (policy, publisher):
            await _remember_for(policy, publisher, old, clock.now)
            clock.advance(2950)
            await _remember_for(policy, publisher, new, clock.now)

    asyncio.run(made())
    lines = _rules_listed(tmp_path, "{enabled: true, max_seconds: 600}")
    [older] = [line for line in lines.values() if f"definition {old[:16]}… " in line]
    [newer] = [line for line in lines.values() if f"definition {new[:16]}… " in line]
    assert older.split()[1] == "ended"
    assert "ENDED: approvals.remember.max_seconds is 600 s now, so it ended at " in older
    assert "REFUSED" not in older  # a configuration change, no forgery
    assert newer.split()[1] == "active"
    assert "ENDED" not in newer
    assert "REFUSED" not in newer
    # Under the longer limit both stand; with remembering off, neither does.
    assert [line.split()[1] for line in _rules_listed(tmp_path, "{enabled: true, max_seconds: 3600}").values()] == [
        "active",
        "active",
    ]
    off = _rules_listed(tmp_path, "{enabled: false, max_seconds: 3600}").values()
    assert [line.split()[1] for line in off] == ["ended", "ended"]
    assert all("ENDED: approvals.remember.enabled is off" in line for line in off)


def test_rules_list_prints_a_row_written_around_kazma_on_one_line(tmp_path: Path) -> None:
    # A rule row is a store row: whoever writes the store around Kazma can put a line break (or an escape sequence)
    # in its text. Printed raw, a refused row could push its REFUSED mark away and print a forged "active" line.
    forged = "deploy\nrule_FAKE  active  deploy  sha256 0000"

    async def written() -> None:
        conn = await open_database(tmp_path / "kazma.db", busy_timeout_ms=5000, migrations=all_migrations())
        try:
            await RuleStore(conn).add(
                tool=forged, args_hash="ab" * 32, conversation=HERE + "\x1b[2K", created_by="telegram:111",
                created_via="telegram", request_id="r" * 22, seconds=3600,
            )  # fmt: skip
        finally:
            await conn.close()

    asyncio.run(written())
    lines = _rules_listed(tmp_path, "{enabled: true, max_seconds: 3600}")
    assert "rule_FAKE" not in lines
    [line] = lines.values()
    assert line.split()[1] == "refused"
    assert "⟨U+000A LF⟩rule_FAKE" in line
    assert "\x1b" not in line
    assert "REFUSED: it carries no seal" in line


def test_rules_revoke_refuses_a_rule_no_longer_in_force_as_the_console_does(tmp_path: Path) -> None:
    # An expired rule is in force nowhere: `rules revoke` said "revoked" for it and wrote a rule_revoked the audit
    # then shows for a rule that ended an hour before, where the console's Revoke says none is in force.
    from click.testing import CliRunner

    from kazma.bot.cli import main
    from tests.audit_support import KEY_ENV

    clock = ManualClock(time.time() - 7200)

    async def made() -> str:
        async with remembering(tmp_path, clock) as (policy, publisher):
            await _remember(policy, publisher)
            [rule] = await policy.service.rules.list()  # type: ignore[union-attr]
            return rule.id

    rule_id = asyncio.run(made())
    config = tmp_path / "kazma.yaml"
    config.write_text(
        f"store: {{path: '{tmp_path / 'kazma.db'}'}}\napprovals:\n  approvers: ['telegram:111']\n", encoding="utf-8"
    )
    result = CliRunner().invoke(main, ["-c", str(config), "approvals", "rules", "revoke", rule_id], env=KEY_ENV)
    assert result.exit_code == 1, result.output
    assert f"no rule {rule_id!r} in force" in result.stderr

    async def revocations() -> list[str]:
        conn = await open_database(tmp_path / "kazma.db", busy_timeout_ms=5000, migrations=all_migrations())
        try:
            [rule] = await RuleStore(conn).list(active_only=False)
            assert rule.revoked_at is None
            return [e.event for e in await ApprovalStore(conn).events(rule.request_id, event="rule_revoked")]
        finally:
            await conn.close()

    assert asyncio.run(revocations()) == []


def test_rules_list_without_a_decision_key_calls_no_rule_active(tmp_path: Path) -> None:
    # Without a usable decision key the listing cannot tell a rule Kazma sealed from a row written by hand: it
    # listed both as active. It now says the seal could not be checked, as kazma approvals show does.
    from click.testing import CliRunner

    from kazma.bot.cli import main

    clock = ManualClock(time.time() - 60)

    async def made() -> None:
        async with remembering(tmp_path, clock) as (policy, publisher):
            await _remember(policy, publisher)

    asyncio.run(made())
    config = tmp_path / "kazma.yaml"
    config.write_text(
        f"store: {{path: '{tmp_path / 'kazma.db'}'}}\n"
        "approvals:\n  approvers: ['telegram:111']\n  remember: {enabled: true, max_seconds: 3600}\n",
        encoding="utf-8",
    )
    result = CliRunner().invoke(
        main, ["-c", str(config), "approvals", "rules", "list"], env={"KAZMA_DECISION_KEY": None}
    )
    assert result.exit_code == 0, result.output
    [line] = [line for line in result.stdout.splitlines() if line.startswith("rule_")]
    assert line.split()[1] == "unchecked"
    assert "UNCHECKED: its seal cannot be checked here: no usable decision key (kazma doctor says why)" in line
    # With the key, the same rule is active: the rule is genuine, only the listing could not tell.
    keyed = _rules_listed(tmp_path, "{enabled: true, max_seconds: 3600}")
    assert [listed.split()[1] for listed in keyed.values()] == ["active"]


def test_rules_list_says_when_older_rules_are_left_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --all lists every rule ever made, which grows without bound; past the listing's limit the oldest were left
    # off without a word, so a rule looked up there seemed never to have existed.
    from kazma.bot.cli import rules_cli

    monkeypatch.setattr(rules_cli, "LISTED", 2, raising=False)  # (before: a fixed 1000, none said)

    async def written() -> list[str]:
        conn = await open_database(tmp_path / "kazma.db", busy_timeout_ms=5000, migrations=all_migrations())
        clock = ManualClock(time.time() - 10_000)
        made = []
        try:
            for n in range(3):
                clock.advance(60)
                rule = await RuleStore(conn, clock=clock).add(
                    tool="deploy", args_hash=f"{n:02}" * 32, conversation=HERE, created_by="telegram:111",
                    created_via="telegram", request_id="r" * 22, seconds=600,
                )  # fmt: skip
                made.append(rule.id)
        finally:
            await conn.close()
        return made

    oldest, *newest = asyncio.run(written())
    from click.testing import CliRunner

    from kazma.bot.cli import main
    from tests.audit_support import KEY_ENV

    config = tmp_path / "kazma.yaml"
    config.write_text(f"store: {{path: '{tmp_path / 'kazma.db'}'}}\n", encoding="utf-8")
    result = CliRunner().invoke(main, ["-c", str(config), "approvals", "rules", "list", "--all"], env=KEY_ENV)
    assert result.exit_code == 0, result.output
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("rule_")]
    assert listed == newest[::-1]
    assert oldest not in result.stdout
    assert "only the newest 2 rules are listed; older ones are left off" in result.stderr


async def test_a_listing_reads_rules_alike_on_both_engines(store_engine: Engine) -> None:
    """A listing reads every rule's approval and audit rows at once (ApprovalStore.requests_of, events_of): on
    SQLite and on PostgreSQL it says of each rule what reading it alone says, whatever the ids' number."""
    clock = ManualClock()
    async with remembering_on(store_engine, clock) as (policy, publisher):
        for definition in ("a" * 64, "b" * 64, "c" * 64):
            await _remember_for(policy, publisher, definition, clock.now)
        service = policy.service
        assert service.rules is not None
        [first, *_] = found = await service.rules.list(active_only=False)
        await service.revoke_rule(first.id, actor="cli:ops", platform="cli")
        found = await service.rules.list(active_only=False)
        ids = [rule.request_id for rule in found] + ["no_such_request"]
        store = service.store
        assert await store.requests_of(ids) == {i: r for i in ids if (r := await store.get(i)) is not None}
        kinds = ("decided", "rule_revoked")
        one_by_one = {i: [e for k in kinds for e in await store.events(i, event=k)] for i in ids}
        assert {i: sorted(e, key=lambda e: e.seq) for i, e in (await store.events_of(ids, kinds)).items()} == {
            i: sorted(e, key=lambda e: e.seq) for i, e in one_by_one.items() if e
        }
        now = clock.now
        alone = [
            (await rule_standing(store, rule, config=service.config, keyring=TEST_KEYRING, now=now))[0]
            for rule in found
        ]
        assert await rule_states(store, found, config=service.config, keyring=TEST_KEYRING, now=now) == alone
        assert {state.name for state in alone} == {"active", "revoked"}
