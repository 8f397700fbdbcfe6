"""Approved, then Kazma stopped before the call finished: at the restart the execution record says whether the
call started, and every place that shows the request says so — the conversation, every card (edited again,
even one already settled to "approved"), the approval's page.

The stop is made the way a process that died leaves things: the decision committed, the call verified (its
``execution_started`` audited), and then either nothing in the execution record (it never started) or a row
never finished (it may have run). The chaos matrix crosses the same windows with a real process killed at
``tools.verified``, ``tools.started`` and ``approvals.decide.after_commit`` (its checker holds every card and
the conversation to these words).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kazma.adapters.card_layout import outcome_line
from kazma.approvals.model import Decision, Status
from kazma.approvals.service import ExecutionLookup
from kazma.bot.console.pages import approval_page
from tests.approvals_support import RecordingPublisher, approval_service

ARGS = {"path": "a"}


@dataclass
class _Viewer:
    login: str = "admin"
    role: str = "operator"
    csrf: str = "c" * 32
    is_operator: bool = True
    may_decide: bool = True

    def may_decide_under(self, policy: str | None) -> bool:
        return self.may_decide

    proven: bool = True
    who: str = "admin (web:admin, passkey)"


async def _approved_and_verified(db: Path) -> str:
    """A request approved from its (settled) card, its call verified to run; then the process is gone."""
    async with approval_service(db) as service:
        request = await service.open("write_file", ARGS, "agent:builder", "telegram:-1001")
        await service.store.record_card(request.id, "telegram", "-1001", "7")
        assert (await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
        (card,) = await service.store.cards(request.id)
        await service.store.mark_card_settled(card, Status.APPROVED)
        await service.verify_execution(request.id, "write_file", ARGS)
        return request.id


def _record(rows: Mapping[str, list[str | None]]) -> ExecutionLookup:
    async def lookup(ids: Sequence[str]) -> Mapping[str, list[str | None]]:
        return {i: rows[i] for i in ids if i in rows}

    return lookup


async def test_verified_but_never_started_says_did_not_run_everywhere(tmp_path: Path) -> None:
    db = tmp_path / "k.db"
    request_id = await _approved_and_verified(db)
    publisher = RecordingPublisher()
    async with approval_service(db, publisher=publisher) as restarted:
        restarted.executions_of = _record({})
        recovery = await restarted.recover()
        assert [r.id for r in recovery.never_ran] == [request_id]
        (told,) = [text for conversation, text in recovery.messages() if conversation == "telegram:-1001"]
        assert "did not run" in told
        # its card is to be edited again, and the bus will find what to add to it
        assert publisher.settled == [request_id]
        (card,) = await restarted.store.cards(request_id)
        assert card.settled_at is None
        assert card.settled_status == "approved"
        note = await restarted.store.execution_note(request_id)
        assert note is not None
        assert "did not run" in note
        request = await restarted.store.get(request_id)
        assert request is not None
        outcome = request.outcome()
        assert outcome is not None
        line = outcome_line(replace(outcome, afterwards=note))  # what every platform's settled card shows
        assert line.startswith("APPROVED by")
        assert "did not run and will not run on its own" in line
        page = approval_page(_Viewer(), request, await restarted.store.events(request_id), [card],
                             public_url="http://127.0.0.1:8765")  # fmt: skip
        assert "<th>Ran</th>" in page
        assert "did not run" in page
        # reported once: the next start says nothing more
        again = await restarted.recover()
        assert (again.never_ran, again.may_have_run) == ([], [])


async def test_started_and_never_finished_says_may_have_run(tmp_path: Path) -> None:
    db = tmp_path / "k.db"
    request_id = await _approved_and_verified(db)
    async with approval_service(db, publisher=RecordingPublisher()) as restarted:
        restarted.executions_of = _record({request_id: ["lost"]})
        recovery = await restarted.recover()
        assert recovery.never_ran == []
        assert [r.id for r in recovery.may_have_run] == [request_id]
        (told,) = [text for conversation, text in recovery.messages() if conversation == "telegram:-1001"]
        assert "may have run (started, not finished)" in told
        note = await restarted.store.execution_note(request_id)
        assert note is not None
        assert "may have run" in note


async def test_a_call_that_ran_to_its_end_is_not_reported(tmp_path: Path) -> None:
    db = tmp_path / "k.db"
    request_id = await _approved_and_verified(db)
    async with approval_service(db, publisher=RecordingPublisher()) as restarted:
        restarted.executions_of = _record({request_id: ["ok"]})
        recovery = await restarted.recover()
        assert (recovery.never_ran, recovery.may_have_run, recovery.messages()) == ([], [], [])
        (card,) = await restarted.store.cards(request_id)
        assert card.settled_at is not None  # its card stands as it was
