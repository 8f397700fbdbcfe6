"""U+0000 in text: kept by both backends alike (PostgreSQL refuses it in text; Kazma escapes it at its connections).

A model's answer, a tool's output or a message may hold NUL. On SQLite it was stored; on PostgreSQL the same
write failed with ``DataError``, losing a swarm step's record or a turn of chat history. These tests write
such text through the real stores on both engines and read it back unchanged.
"""

from __future__ import annotations

import pytest

from kazma.config.store.pg_text import ESCAPE, decode, encode
from kazma.engine.history import HistoryStore
from kazma.engine.swarm.store import SwarmTaskStore
from kazma.engine.swarm.types import Pattern, WorkerResult
from kazma.engine.transcript import TranscriptStore
from tests.store_backends import Engine, open_store, raw_rows

NASTY = [
    "before\x00after",
    "\x00",
    f"{ESCAPE}0 is not a NUL",
    f"{ESCAPE}{ESCAPE}\x00{ESCAPE}",
    "plain text, nothing to escape",
    "ends with the escape " + ESCAPE,
]


@pytest.mark.parametrize("text", NASTY)
def test_the_escaping_is_reversible_and_leaves_no_nul(text: str) -> None:
    stored = encode(text)
    assert "\x00" not in stored
    assert decode(stored) == text


def test_text_without_either_character_is_stored_as_it_is() -> None:
    assert encode("kazma ✓") == "kazma ✓"
    assert decode("kazma ✓") == "kazma ✓"


async def test_swarm_step_records_with_nul_round_trip(store_engine: Engine) -> None:
    async with open_store(store_engine) as conn:
        store = SwarmTaskStore(conn)
        run = await store.admit(Pattern.PIPELINE, {"prompt": "p\x00q"}, owner="telegram:111")
        for index, text in enumerate(NASTY):
            result = WorkerResult("builder", False, output=text, error=f"error {text}")
            assert await store.journal(run, index, "builder", result)
            seq = await store.start_call(run, "builder", step=f"stage {index + 1}", attempt=1)
            await store.finish_call(run.task_id, seq, result)
        journal = await store.journaled(run.task_id)
        assert [s.output for s in journal] == NASTY
        assert [s.error for s in journal] == [f"error {t}" for t in NASTY]
        assert [c.error for c in await store.calls(run.task_id)] == [f"error {t}" for t in NASTY]
        record = await store.get(run.task_id)
        assert record is not None
        assert record.request["prompt"] == "p\x00q"
    if store_engine.postgres:  # stored escaped: PostgreSQL never saw a NUL
        (row,) = raw_rows(store_engine, "SELECT output FROM swarm_steps WHERE idx = 0")
        assert "\x00" not in str(row[0])


async def test_chat_history_and_transcript_with_nul_round_trip(store_engine: Engine) -> None:
    async with open_store(store_engine) as conn:
        history = HistoryStore(conn)
        for text in NASTY:
            await history.append("telegram:-1001", "kazma", "assistant", text)
        assert [m["content"] for m in await history.recent("telegram:-1001", "kazma")] == NASTY
        transcript = TranscriptStore(conn)
        kept = await transcript.record("telegram", "-1001", author="1\x001", name="ops\x00", text=NASTY[0],
                                       direction="in")  # fmt: skip
        (line,) = await transcript.messages("telegram:-1001")
        assert (line.author, line.name, line.text) == ("1\x001", "ops\x00", kept.text)
