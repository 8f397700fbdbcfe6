"""One way into every adapter: ``send(to: Address, message: Outgoing)``. Text, a question and a file go where the
address says, on every platform; an address on another platform is refused before any call. Along the path
(the engine's sink, the transcript, the bus, the adapter) the address and the message travel as the two values,
never as a platform, a chat, a thread and an agent handed on one by one."""

from __future__ import annotations

import inspect

import pytest

from kazma.adapters.bus import FanOutBus, NullBus
from kazma.adapters.contract import PlatformAdapter, PlatformError
from kazma.adapters.terminal import TerminalAdapter
from kazma.adapters.web.adapter import WebAdapter
from kazma.config.address import Address
from kazma.config.outgoing import Outgoing
from kazma.engine.conversation import MessageSink
from kazma.engine.transcript import Bus, RecordingSink
from tests.contract.harness import Harness

pytestmark = pytest.mark.filterwarnings("ignore:.*retry_after.*:telegram.warnings.PTBDeprecationWarning")


async def test_text_a_question_and_a_file_go_where_the_address_says(harness: Harness) -> None:
    adapter = await harness.start()
    home = Address(harness.platform, harness.home)
    assert await adapter.send(home, Outgoing("the plan is done", agent="builder"))
    assert await adapter.send(home, Outgoing.question("Which one?", [("First", "kq1:q1:0"), ("Second", "kq1:q1:1")]))
    assert await adapter.send(home, Outgoing.of_file("notes.txt", b"the notes\n", agent="builder"))
    assert harness.bot_texts(harness.home)[0].endswith("the plan is done")
    [(name, data, caption)] = harness.files_posted(harness.home)
    assert (name, data) == ("notes.txt", b"the notes\n")
    assert "builder" in caption


async def test_an_address_on_another_platform_is_refused_before_any_call(harness: Harness) -> None:
    adapter = await harness.start()
    with pytest.raises(PlatformError) as caught:
        await adapter.send(Address("elsewhere", harness.home), Outgoing("hello"))
    assert (caught.value.site, caught.value.retryable) == ("send", False)
    assert harness.bot_texts(harness.home) == []


async def test_the_console_and_the_terminal_take_the_same_values() -> None:
    console = WebAdapter()
    sent = await console.send(Address("web", "room", "t1"), Outgoing.question("Go?", [("Yes", "kq1:q:0")]))
    [message] = console.messages("room")
    assert (message.id, message.text, message.choices) == (sent, "Go?", (("Yes", "kq1:q:0"),))
    with pytest.raises(PlatformError):
        await console.send(Address("cli", "room"), Outgoing("hello"))
    with pytest.raises(PlatformError) as caught:  # the terminal posts no files, and says so
        await TerminalAdapter(interactive=False).send(Address("cli", "terminal"), Outgoing.of_file("a", b"1"))
    assert caught.value.site == "send_file"


@pytest.mark.parametrize("holder", [PlatformAdapter, MessageSink, Bus, RecordingSink, FanOutBus, NullBus])
def test_the_send_path_takes_an_address_and_a_message(holder: type) -> None:
    signature = inspect.signature(getattr(holder, "send"))  # noqa: B009 - a protocol's, read as a class
    assert list(signature.parameters) == ["self", "to", "message"]
    assert not [name for name in ("send_choices", "send_file") if hasattr(holder, name)], holder
