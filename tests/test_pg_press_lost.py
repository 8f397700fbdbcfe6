"""A press on PostgreSQL guessed to lose to a press of its request guessed to win earlier in the same transaction
(approvals/pg_press.py ``lost_on_guess``): the server is asked only for its card check, and it is told the request
as the winner left it. Attacked here: the card check must refuse exactly what ``kazma_press_on_guess`` refuses (a
card problem fails the guess, and the group run again names it), and the loser must still be told what beat it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator

import psycopg
import pytest

from kazma.approvals import ApprovalService, ApprovalStore, Decision, button_data
from kazma.approvals.audit_verify import verify
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.model import ApprovalRequest, Status
from kazma.approvals.pg_press import _LOST_CARD_CHECK, _PRESS_GUESSED_CALL, LOST, PG_PRESS_ON_GUESS_FUNCTION
from kazma.bot.store import pg_migrations
from kazma.config.store.postgres import STALE_GUESS, PgStore, PgWriter, open_pg_store, pyformat
from tests.approvals_support import TEST_KEYRING, TEST_SIGNER, approvals_config
from tests.pg_support import find_bindir

pytestmark = pytest.mark.skipif(find_bindir() is None, reason="PostgreSQL server binaries are not installed")

# kazma_press_on_guess as migration 17 made it, but noting each call's guess in a table first.
_COUNTED = PG_PRESS_ON_GUESS_FUNCTION.replace(
    "BEGIN\n    IF p_outcome = 'won' THEN",
    "BEGIN\n    INSERT INTO guess_calls VALUES (p_outcome);\n    IF p_outcome = 'won' THEN",
)


@contextlib.asynccontextmanager
async def one_replica(dsn: str) -> AsyncIterator[tuple[ApprovalService, PgWriter]]:
    backend: PgStore = await open_pg_store(dsn, migrations=pg_migrations(), application_name="lost")
    try:
        store = ApprovalStore(backend, keyring=TEST_KEYRING, audit=TEST_SIGNER)
        yield ApprovalService(store, approvals_config()), await backend.writer()
    finally:
        await backend.close()


async def checked_log(service: ApprovalService) -> list[tuple[str, str | None, str | None]]:
    await Checkpointer(service.store, TEST_SIGNER, min_interval=0.0).sign()
    events = await service.store.chain_events(limit=10_000)
    report = verify(events, await service.store.chain_checkpoints(limit=10_000), TEST_SIGNER.public_keys())
    assert report.ok, [p.line() for p in report.problems]
    return [(e.event, e.request_id, e.actor) for e in events]


async def test_a_loser_from_its_card_is_told_the_winners_outcome_without_the_press_function(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        async with one_replica(pg_dsn) as (service, writer):
            admin.execute("CREATE TABLE guess_calls (outcome text)")
            admin.execute(_COUNTED)
            opened = [await service.open("shell", {"n": n}, "agent:builder", "telegram:-100") for n in range(3)]
            for request in opened:
                await service.store.record_card(request.id, "telegram", "-100", "1")
                await service.store.record_card(request.id, "slack", "C1", "2", bound_to="slack:U111")
            retries = writer.pipeline_retries
            results = await asyncio.gather(
                *(
                    press
                    for r in opened
                    for press in (
                        service.decide_from_button(button_data(r.id, Decision.DENY), actor="telegram:111",
                                                   platform="telegram", chat="-100", message_id="1"),
                        service.decide_from_button(button_data(r.id, Decision.APPROVE), actor="slack:U111",
                                                   platform="slack", chat="C1", message_id="2"),
                    )
                )
            )  # fmt: skip
            assert writer.pipeline_retries == retries  # every guess held
            for n in range(len(opened)):
                won, lost = results[2 * n], results[2 * n + 1]
                assert won.won
                assert not lost.won
                assert lost.outcome is not None
                assert lost.outcome.status is Status.DENIED
                assert lost.outcome.decided_by == "telegram:111"
            log = await checked_log(service)
            calls = [row[0] for row in admin.execute("SELECT outcome FROM guess_calls").fetchall()]
    assert calls == ["won"] * len(opened)  # the losers' card checks found nothing to ask the function about
    assert [(e, a) for e, _, a in log if e in ("decided", "press_lost")] == [
        ("decided", "telegram:111"),
        ("press_lost", "slack:U111"),
    ] * len(opened)


async def test_a_loser_from_a_place_without_a_card_fails_the_guess_and_is_refused(pg_dsn: str) -> None:
    async with one_replica(pg_dsn) as (service, writer):
        request = await service.open("shell", {"command": "ls"}, "agent:builder", "telegram:-100")
        await service.store.record_card(request.id, "telegram", "-100", "1")
        await service.store.record_card(request.id, "slack", "C1", "2")
        retries = writer.pipeline_retries
        won, lost = await asyncio.gather(
            service.decide_from_button(button_data(request.id, Decision.APPROVE), actor="telegram:111",
                                       platform="telegram", chat="-100", message_id="1"),
            service.decide_from_button(button_data(request.id, Decision.DENY), actor="slack:U111",
                                       platform="slack", chat="C-other", message_id="9"),
        )  # fmt: skip
        assert writer.pipeline_retries > retries  # the loser's card check failed the guess
        assert won.won
        assert not lost.won
        stored = await service.store.get(request.id)
        assert stored is not None
        assert stored.status is Status.APPROVED
        log = await checked_log(service)
    # The group run again without guessing decided both once: one event for each press, not the stale attempt's.
    assert [e for e in log if e[2] == "telegram:111"] == [("decided", request.id, "telegram:111")]
    assert len([e for e in log if e[2] == "slack:U111"]) == 1
    assert ("card_found", request.id, None) in log  # the unguessed press met the place without a card


def _raises_stale(conn: psycopg.Connection[tuple[object, ...]], sql: str, params: tuple[object, ...]) -> bool:
    try:
        with conn.transaction():
            conn.execute(pyformat(sql), params).fetchall()
    except psycopg.Error as exc:
        if exc.sqlstate != STALE_GUESS:
            raise
        return True
    return False


async def test_the_losers_card_check_refuses_exactly_what_the_press_function_refuses(pg_dsn: str) -> None:
    # Every card set against every place a press can come from: the plain check must call the function (which
    # fails the guess) for every press the function refuses, or a loser from a wrong card would be told it lost.
    card_sets: list[list[tuple[str, str, int, str | None]]] = [
        [],
        [("-100", "1", 1, None)],
        [("-100", "1", 0, None)],
        [("-100", "1", 1, "telegram:111")],
        [("-100", "1", 1, "person:alice")],
        [("-100", "1", 1, "telegram:999")],
        [("-100", "1", 0, None), ("-200", "2", 1, None)],
        [("-100", "1", 1, "telegram:999"), ("-100", "3", 1, None)],
    ]
    async with one_replica(pg_dsn) as (service, _):
        requests: list[ApprovalRequest] = []
        for cards in card_sets:
            request = await service.open("shell", {"cards": len(requests)}, "agent:builder", "telegram:-100")
            for card_chat, card_message, whole, bound_to in cards:
                await service.store.record_card(request.id, "telegram", card_chat, card_message, whole=bool(whole),
                                                bound_to=bound_to)  # fmt: skip
            requests.append(request)
    refused = 0
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for request in requests:
            conn.execute("UPDATE approval_requests SET status = 'approved' WHERE id = %s", (request.id,))
            for chat, message, person, needs_whole in itertools.product(
                (None, "-100", "-200"), (None, "1", "2", "3"), (None, "person:alice"), (False, True)
            ):
                actor, bound = "telegram:111", person or "telegram:111"
                function = (LOST, "approved", None, request.id, "denied", actor, "telegram", 2e9, None, None,
                            None, person, request.tool, request.args_hash, bound, "deny", True, chat, message,
                            needs_whole)  # fmt: skip
                check = (chat, message, needs_whole, chat, chat, message, message, bound, request.id, "telegram",
                         *function)  # fmt: skip
                expected = _raises_stale(conn, _PRESS_GUESSED_CALL, function)
                assert _raises_stale(conn, _LOST_CARD_CHECK, check) == expected, (request.id, chat, message, person)
                refused += expected
    assert refused > 0  # the matrix holds presses the function refuses, and (above) presses it lets lose


async def test_a_press_in_the_group_after_its_requests_winner_still_goes_as_one_string(pg_dsn: str) -> None:
    # Three presses of one request, at most two operations per group: the third lands in the next group, after the
    # winner committed. Guessed to lose to the outcome committed here, its group goes as one string too.
    async with one_replica(pg_dsn) as (service, writer):
        # Two opens: the chain's second append found the head it expected, so its guesses hold from then on.
        await service.open("shell", {"command": "pwd"}, "agent:builder", "telegram:-100")
        request = await service.open("shell", {"command": "ls"}, "agent:builder", "telegram:-100")
        writer.max_group = 2
        retries, from_loop, groups = writer.pipeline_retries, writer.sent_from_loop, writer.groups
        results = await asyncio.gather(
            *(
                service.decide_from_button(button_data(request.id, decision), actor=actor, platform=platform)
                for decision, actor, platform in (
                    (Decision.DENY, "telegram:111", "telegram"),
                    (Decision.APPROVE, "slack:U111", "slack"),
                    (Decision.APPROVE, "discord:222", "discord"),
                )
            )
        )
        assert writer.groups - groups == 2
        assert writer.sent_from_loop - from_loop == 2  # neither group went to the writer thread
        assert writer.pipeline_retries == retries
        assert [r.won for r in results] == [True, False, False]
        for lost in results[1:]:
            assert lost.outcome is not None
            assert lost.outcome.status is Status.DENIED
            assert lost.outcome.decided_by == "telegram:111"
        log = await checked_log(service)
    assert [(e, a) for e, _, a in log if e in ("decided", "press_lost")] == [
        ("decided", "telegram:111"),
        ("press_lost", "slack:U111"),
        ("press_lost", "discord:222"),
    ]
