"""The approvals side of the trust boundary, attacked: forged rows, presses from elsewhere, cut cards, orphans."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kazma.approvals import Decision, ExecutionMismatch, PressVerdict, SafetyPolicy, Status, button_data
from kazma.approvals.service import RESTARTED
from kazma.config import load_config_text
from kazma.config.metrics import failure_count
from tests.approvals_support import APPROVERS_YAML, RecordingPublisher, approval_service
from tests.outside_writes import write_around
from tests.test_web_server import console, until

ARGS = {"command": "deploy --prod"}


async def test_a_row_forged_to_approved_without_its_audit_does_not_run(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db") as service:
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        # What one approved shell command could do to the file if it could reach it: approve in SQL.
        await write_around(
            tmp_path / "k.db",
            [
                (
                    "UPDATE approval_requests SET status = 'approved', decided_by = 'telegram:111',"
                    " decided_via = 'telegram', decided_at = 1 WHERE id = ?",
                    (request.id,),
                )
            ],
        )
        before = failure_count("approval_forged")
        with pytest.raises(ExecutionMismatch, match="carries no decision seal"):
            await service.verify_execution(request.id, "shell", ARGS)
        assert failure_count("approval_forged") == before + 1
        assert [e.event for e in await service.store.events(request.id)][-1] == "execution_refused"


async def test_a_forged_approval_with_a_forged_audit_row_by_a_non_approver_does_not_run(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db") as service:
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        await write_around(  # the row and an audit row, both written by hand
            tmp_path / "k.db",
            [
                (
                    "UPDATE approval_requests SET status = 'approved', decided_by = 'telegram:999',"
                    " decided_via = 'telegram', decided_at = 1 WHERE id = ?",
                    (request.id,),
                ),
                (
                    "INSERT INTO approval_events (request_id, event, actor, platform, at, args_hash)"
                    " VALUES (?, 'decided', 'telegram:999', 'telegram', 1, ?)",
                    (request.id, request.args_hash),
                ),
            ],
        )
        before = failure_count("approval_forged")
        with pytest.raises(ExecutionMismatch, match="carries no decision seal"):
            await service.verify_execution(request.id, "shell", ARGS)
        assert failure_count("approval_forged") == before + 1


async def test_an_approval_of_a_stored_call_changed_after_it_was_opened_does_not_run(tmp_path: Path) -> None:
    # The person read the stored call (approval page, `kazma approvals show`) and approved; the call the waiter
    # holds still hashes to the approved hash, but what the person read was not it.
    async with approval_service(tmp_path / "k.db") as service:
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        await write_around(
            tmp_path / "k.db",
            [("UPDATE approval_requests SET args_json = ? WHERE id = ?", ('{"command":"echo harmless"}', request.id))],
        )
        won = await service.decide(request.id, Decision.APPROVE, actor="cli:ops", platform="cli")
        assert won.verdict is PressVerdict.WON
        before = failure_count("approval_forged")
        with pytest.raises(ExecutionMismatch, match="its stored call was changed"):
            await service.verify_execution(request.id, "shell", ARGS)
        assert failure_count("approval_forged") == before + 1
        refused = (await service.store.events(request.id, event="execution_refused"))[-1]
        assert refused.detail is not None
        assert refused.detail.startswith("its stored call was changed (the stored arguments hash to ")


async def test_the_policy_refuses_a_forged_approval_a_waiter_sees(tmp_path: Path) -> None:
    publisher = RecordingPublisher()
    async with approval_service(tmp_path / "k.db", publisher=publisher, poll_interval=0.01) as service:
        policy = SafetyPolicy(service)
        check = asyncio.create_task(policy.check("shell", ARGS, requested_by="agent:b", conversation="telegram:-1"))
        while not publisher.published:
            await asyncio.sleep(0)
        await write_around(
            tmp_path / "k.db",
            [
                (
                    "UPDATE approval_requests SET status = 'approved', decided_by = 'telegram:111',"
                    " decided_via = 'telegram', decided_at = 1 WHERE id = ?",
                    (publisher.published[0].request_id,),
                )
            ],
        )
        verdict = await asyncio.wait_for(check, timeout=10)
        assert not verdict.allowed
        assert "carries no decision seal" in verdict.reason


async def test_a_genuine_approval_runs_and_is_recorded_as_started(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db") as service:
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        result = await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        assert result.verdict is PressVerdict.WON
        await service.verify_execution(request.id, "shell", ARGS)
        assert "execution_started" in [e.event for e in await service.store.events(request.id)]


async def test_approve_is_refused_from_a_card_that_did_not_show_the_whole_call(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db") as service:
        request = await service.open("shell", {"command": "x" * 20_000}, "agent:builder", "telegram:-100")
        await service.store.record_card(request.id, "telegram", "-100", "7", whole=False)
        data = button_data(request.id, Decision.APPROVE)
        refused = await service.decide_from_button(
            data, actor="telegram:111", platform="telegram", chat="-100", message_id="7"
        )
        assert refused.verdict is PressVerdict.REFUSED
        assert "cannot be approved here" in refused.message
        assert service.link(request.id) in refused.message
        still = await service.store.get(request.id)
        assert still is not None
        assert still.status is Status.PENDING
        # Deny is fine from there; but first: the approval page (no card) can approve the whole call.
        page = await service.decide(request.id, Decision.APPROVE, actor="web:admin", platform="web")
        assert page.verdict is PressVerdict.WON


async def test_deny_is_taken_from_a_cut_card(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db") as service:
        request = await service.open("shell", {"command": "x" * 20_000}, "agent:builder", "telegram:-100")
        await service.store.record_card(request.id, "telegram", "-100", "7", whole=False)
        result = await service.decide_from_button(
            button_data(request.id, Decision.DENY),
            actor="telegram:111",
            platform="telegram",
            chat="-100",
            message_id="7",
        )
        assert result.verdict is PressVerdict.WON


async def test_a_press_counts_only_from_the_cards_own_chat_and_message(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db") as service:
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        await service.store.record_card(request.id, "telegram", "-100", "7")
        data = button_data(request.id, Decision.APPROVE)
        elsewhere = await service.decide_from_button(
            data, actor="telegram:111", platform="telegram", chat="-999", message_id="7"
        )
        other_message = await service.decide_from_button(
            data, actor="telegram:111", platform="telegram", chat="-100", message_id="8"
        )
        for result in (elsewhere, other_message):
            assert result.verdict is PressVerdict.REFUSED
            assert result.message == "This button is not on a card of that request."
        events = [e for e in await service.store.events(request.id) if e.event == "press_refused"]
        assert events  # audited (the first in the window)
        here = await service.decide_from_button(
            data, actor="telegram:111", platform="telegram", chat="-100", message_id="7"
        )
        assert here.verdict is PressVerdict.WON


async def test_start_up_cancels_orphans_keeps_durable_waiters_and_reports_approved_calls_that_never_ran(
    tmp_path: Path,
) -> None:
    async with approval_service(tmp_path / "k.db") as service:
        orphan = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        checkpoint = await service.open("swarm_checkpoint", {"task": "t"}, "swarm:t", "slack:C1", durable=True)
        approved = await service.open("write_file", {"path": "a"}, "agent:builder", "discord:5")
        await service.decide(approved.id, Decision.APPROVE, actor="telegram:111", platform="telegram")

    async with approval_service(tmp_path / "k.db") as restarted:  # the process that opened them is gone
        recovery = await restarted.recover()
        assert [r.id for r in recovery.cancelled] == [orphan.id]
        assert [r.id for r in recovery.never_ran] == [approved.id]
        ended = await restarted.store.get(orphan.id)
        assert ended is not None
        assert (ended.status, ended.reason) == (Status.CANCELLED, RESTARTED)
        kept = await restarted.store.get(checkpoint.id)
        assert kept is not None
        assert kept.status is Status.PENDING
        told = dict(recovery.messages())
        assert RESTARTED in told["telegram:-100"]
        assert "did not run" in told["discord:5"]
        # reported once, not at every start
        again = await restarted.recover()
        assert (again.cancelled, again.never_ran) == ([], [])


async def test_with_approve_cut_in_chat_a_cut_card_may_approve(tmp_path: Path) -> None:
    # The team's opt-in (approvals.approve_cut_in_chat) is what the refusal above hangs on: with it, the same
    # press from the same cut card wins; without it (the default, above) it is refused.
    opted_in = APPROVERS_YAML.replace("approvals:\n", "approvals:\n  approve_cut_in_chat: true\n")
    config = load_config_text(opted_in).config
    assert config.approvals.approve_cut_in_chat
    async with approval_service(tmp_path / "k.db", config=config) as service:
        request = await service.open("shell", {"command": "x" * 20_000}, "agent:builder", "telegram:-100")
        await service.store.record_card(request.id, "telegram", "-100", "7", whole=False)
        result = await service.decide_from_button(
            button_data(request.id, Decision.APPROVE),
            actor="telegram:111",
            platform="telegram",
            chat="-100",
            message_id="7",
        )
        assert result.verdict is PressVerdict.WON
        row = await service.store.get(request.id)
        assert row is not None
        assert row.status is Status.APPROVED


async def test_the_bus_posts_no_card_for_a_row_changed_before_its_post_and_ends_it(tmp_path: Path) -> None:
    publisher = RecordingPublisher()
    async with console(tmp_path) as con:
        # Opened by another process (the CLI, a replica): this bus posts the cards from the rows it reads.
        async with approval_service(tmp_path / "k.db", publisher=publisher) as other:
            honest = await other.open("shell", {"command": "ls"}, "agent:builder", "web:console")
            changed = await other.open("shell", {"command": "ls"}, "agent:builder", "web:console")
        await write_around(  # what runs is changed, the hash people see is kept
            tmp_path / "k.db",
            [("UPDATE approval_requests SET args_json = ? WHERE id = ?", ('{"command":"rm -rf ~"}', changed.id))],
        )
        before = failure_count("card_integrity")
        for card in publisher.published:
            await con.app.bus.publish(card)
        await until(con.web, lambda: con.web.card_message(honest.id) is not None)
        async with asyncio.timeout(10):
            while (row := await con.app.service.store.get(changed.id)) is not None and row.status is Status.PENDING:
                await asyncio.sleep(0.02)
        assert row is not None
        assert row.status is Status.CANCELLED
        assert row.reason is not None
        assert "changed outside Kazma" in row.reason
        assert con.web.card_message(changed.id) is None  # no card for it, anywhere
        assert not any("rm -rf" in m.text for m in con.web.messages())
        assert [e.event for e in await con.app.service.store.events(changed.id)][-2:] == ["card_refused", "cancelled"]
        assert failure_count("card_integrity") == before + 1
