"""The console reads ``@name`` by the chat platforms' rule (tests/contract/mention_cases.py holds both to it)."""

from __future__ import annotations

import pytest

from kazma.adapters.web import WebAdapter
from tests.contract.harness import Recorder
from tests.contract.mention_cases import MENTION_CASES


@pytest.mark.parametrize(("text", "names"), MENTION_CASES)
async def test_the_console_names_the_agents_a_chat_platform_would(text: str, names: tuple[str, ...]) -> None:
    recorder = Recorder()
    web = WebAdapter()
    await web.start(recorder.handlers())
    try:
        await web.say("alice", text)
    finally:
        await web.stop()
    [inbound] = recorder.inbound
    assert inbound.mentions == names
