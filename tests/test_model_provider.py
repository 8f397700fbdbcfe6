"""The model providers: the real OpenAI-compatible client over real HTTP against a local fake, and the scripted one.

Nothing here mocks httpx: every OpenAIProvider test sends real requests to
:class:`tests.fakes.openai.FakeOpenAI` on 127.0.0.1. Backoff is checked through
an injected recording ``sleep``, so no test waits for a retry or measures time.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from kazma.config.models import ModelConfig
from kazma.engine import answer_stream
from kazma.engine.model import _BACKOFF, OpenAIProvider, ScriptedProvider
from kazma.engine.types import Message, ModelError, ModelProvider, ModelReply, ToolCall, ToolSpec, Usage
from tests.fakes.openai import Completion, FakeOpenAI, FakeToolCall, Garbage, Hang, HttpError

KEY = "sk-kazma-test-0123456789abcdef"
MODEL = "fake-model"

MESSAGES: list[Message] = [
    {"role": "system", "content": "You are the builder."},
    {"role": "user", "content": "List the files."},
]
SHELL = ToolSpec(
    name="shell",
    description="Run a shell command in the workspace.",
    parameters={"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
)
READ_FILE = ToolSpec(
    name="read_file",
    description="Read a file from the workspace.",
    parameters={"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
)


class RecordingSleep:
    """Stands in for asyncio.sleep: remembers each requested delay and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


Make = Callable[..., OpenAIProvider]


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    server = FakeOpenAI(api_key=KEY, models=(MODEL, "other-model"))
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def sleeps() -> RecordingSleep:
    return RecordingSleep()


@pytest.fixture
async def make(fake: FakeOpenAI, sleeps: RecordingSleep) -> AsyncIterator[Make]:
    made: list[OpenAIProvider] = []

    def build(**changes: Any) -> OpenAIProvider:
        settings: dict[str, Any] = {
            "base_url": fake.base_url,
            "api_key": KEY,
            "name": MODEL,
            "timeout_seconds": 5.0,
            "max_retries": 3,
        }
        settings.update(changes)
        provider = OpenAIProvider(ModelConfig(**settings), sleep=sleeps)
        made.append(provider)
        return provider

    yield build
    for provider in made:
        await provider.aclose()


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port bound but not listening: connecting is refused, and nobody else can take it meanwhile."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


# --------------------------------------------------------------------------- replies


async def test_plain_reply_with_usage(fake: FakeOpenAI, make: Make) -> None:
    fake.script(Completion(content="Here are the files.", usage=(42, 7)))
    provider = make()

    reply = await provider.complete(MESSAGES)

    assert reply == ModelReply(
        content="Here are the files.", tool_calls=(), usage=Usage(42, 7), model=MODEL, finish_reason="stop"
    )
    assert provider.calls == 1
    assert provider.usage_total == Usage(42, 7)
    assert provider.label == f"openai-compatible {MODEL} at {fake.base_url}"


async def test_two_tool_calls_in_one_reply(fake: FakeOpenAI, make: Make) -> None:
    fake.script(
        Completion(
            tool_calls=(
                FakeToolCall("shell", '{"command": "ls -la"}', id="call_a"),
                FakeToolCall("read_file", '{"path": "README.md", "limit": 20}', id="call_b"),
            ),
            usage=(100, 30),
        )
    )

    reply = await make().complete(MESSAGES, [SHELL, READ_FILE])

    assert reply.content is None
    assert reply.finish_reason == "tool_calls"
    assert reply.tool_calls == (
        ToolCall(id="call_a", name="shell", arguments={"command": "ls -la"}, raw_arguments='{"command": "ls -la"}'),
        ToolCall(
            id="call_b",
            name="read_file",
            arguments={"path": "README.md", "limit": 20},
            raw_arguments='{"path": "README.md", "limit": 20}',
        ),
    )
    assert all(call.error is None for call in reply.tool_calls)


@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "unindexed"])
async def test_streamed_tool_calls_are_put_together_whether_or_not_their_pieces_carry_an_index(
    fake: FakeOpenAI, make: Make, indexed: bool
) -> None:
    # Some OpenAI-compatible servers stream tool-call pieces without "index": each piece became a call of its own,
    # the name in one, the arguments spread over others ("names no function", "invalid JSON").
    fake.stream_index = indexed
    fake.argument_chunk = 4
    fake.script(
        Completion(
            tool_calls=(
                FakeToolCall("shell", '{"command": "ls -la"}', id="call_a"),
                FakeToolCall("read_file", '{"path": "README.md", "limit": 20}', id="call_b"),
            )
        )
    )

    class Shown:
        def grew(self, text: str) -> None:
            return None

        def dropped(self) -> None:
            return None

    with answer_stream.feeding(Shown()):
        reply = await make(stream=True).complete(MESSAGES, [SHELL, READ_FILE])

    assert [(c.id, c.name, c.arguments, c.error) for c in reply.tool_calls] == [
        ("call_a", "shell", {"command": "ls -la"}, None),
        ("call_b", "read_file", {"path": "README.md", "limit": 20}, None),
    ]
    assert fake.completions[-1].body["stream"] is True  # it was streamed


async def test_request_carries_messages_tools_and_key(fake: FakeOpenAI, make: Make) -> None:
    fake.script(Completion(content="ok"))

    await make().complete(MESSAGES, [SHELL, READ_FILE])

    [request] = fake.completions
    assert request.authorization == f"Bearer {KEY}"
    assert request.body == {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "shell",
                    "description": "Run a shell command in the workspace.",
                    "parameters": SHELL.parameters,
                },
            },
            READ_FILE.as_openai(),
        ],
        "tool_choice": "auto",
    }


async def test_no_tools_and_no_key_send_neither(sleeps: RecordingSleep) -> None:
    async with FakeOpenAI(api_key=None) as open_fake:
        open_fake.script(Completion(content="hi"))
        async with OpenAIProvider(
            ModelConfig(base_url=open_fake.base_url, name=MODEL, api_key=""), sleep=sleeps
        ) as provider:
            reply = await provider.complete(MESSAGES)

        assert reply.content == "hi"
        [request] = open_fake.completions
        assert request.authorization is None
        assert request.body == {"model": MODEL, "messages": MESSAGES}


async def test_model_argument_overrides_the_configured_name(fake: FakeOpenAI, make: Make) -> None:
    fake.script(Completion(content="from the other model"))

    reply = await make().complete(MESSAGES, model="other-model")

    assert fake.completions[0].body["model"] == "other-model"
    assert reply.model == "other-model"


async def test_malformed_tool_arguments_become_errors_not_exceptions(fake: FakeOpenAI, make: Make) -> None:
    fake.script(
        Completion(
            tool_calls=(
                FakeToolCall("shell", '{"command": "ls"', id="call_cut"),
                FakeToolCall("shell", "[1,2]", id="call_list"),
                FakeToolCall("read_file", '{"path": "a.txt"}', id="call_ok"),
            )
        )
    )

    reply = await make().complete(MESSAGES, [SHELL, READ_FILE])

    cut, listed, fine = reply.tool_calls
    assert (cut.id, cut.name, cut.arguments, cut.raw_arguments) == ("call_cut", "shell", {}, '{"command": "ls"')
    assert cut.error is not None
    assert cut.error.startswith("arguments are not a JSON object: ")
    assert (listed.arguments, listed.raw_arguments) == ({}, "[1,2]")
    assert listed.error is not None
    assert listed.error.startswith("arguments are not a JSON object: ")
    assert "array" in listed.error
    assert fine.error is None
    assert fine.arguments == {"path": "a.txt"}


async def test_cumulative_usage_across_calls(fake: FakeOpenAI, make: Make) -> None:
    fake.script(
        Completion(content="one", usage=(10, 1)),
        Completion(content="two", usage=(20, 2)),
        Completion(content="three", usage=None),  # a server that reports no usage counts as zero
    )
    provider = make()

    replies = [await provider.complete(MESSAGES) for _ in range(3)]

    assert [reply.usage for reply in replies] == [Usage(10, 1), Usage(20, 2), Usage(0, 0)]
    assert provider.calls == 3
    assert provider.usage_total == Usage(30, 3)
    assert provider.usage_total.total_tokens == 33


# --------------------------------------------------------------------------- retries


async def test_429_with_retry_after_is_retried_after_that_long(
    fake: FakeOpenAI, make: Make, sleeps: RecordingSleep
) -> None:
    fake.script(
        HttpError(429, {"error": {"message": "Rate limit reached", "type": "requests"}}, retry_after="3"),
        Completion(content="after the pause"),
    )

    reply = await make().complete(MESSAGES)

    assert reply.content == "after the pause"
    assert len(fake.completions) == 2
    assert sleeps.delays == [3.0]


async def test_429_without_retry_after_backs_off(fake: FakeOpenAI, make: Make, sleeps: RecordingSleep) -> None:
    fake.script(HttpError(429), Completion(content="ok"))

    assert (await make().complete(MESSAGES)).content == "ok"
    [delay] = sleeps.delays
    assert 0 < delay <= 1.0


async def test_429_asking_for_a_very_long_wait_is_reported_not_waited(
    fake: FakeOpenAI, make: Make, sleeps: RecordingSleep
) -> None:
    fake.script(HttpError(429, retry_after="3600"), Completion(content="never reached"))

    with pytest.raises(ModelError) as caught:
        await make().complete(MESSAGES)

    assert caught.value.permanent is False
    assert caught.value.status == 429
    assert "3600 s" in str(caught.value)
    assert caught.value.retry_after == 3600.0  # the plan's retry of the step waits for it (bounded there)
    assert len(fake.completions) == 1
    assert sleeps.delays == []


async def test_two_500s_then_success(fake: FakeOpenAI, make: Make, sleeps: RecordingSleep) -> None:
    fake.script(HttpError(500), HttpError(502, "Bad Gateway"), Completion(content="third time", usage=(5, 5)))
    provider = make()

    reply = await provider.complete(MESSAGES)

    assert reply.content == "third time"
    assert len(fake.completions) == 3
    assert [request.status for request in fake.completions] == [500, 502, 200]
    first, second = sleeps.delays
    assert 0 < first <= second  # exponential: the second wait is never shorter than the first
    assert provider.calls == 1
    assert provider.attempts == 3
    assert provider.usage_total == Usage(5, 5)


async def test_500_forever_gives_up_after_max_retries_plus_one(
    fake: FakeOpenAI, make: Make, sleeps: RecordingSleep
) -> None:
    fake.fallback = HttpError(500, {"error": {"message": "The server had an error", "type": "server_error"}})
    provider = make(max_retries=2)

    with pytest.raises(ModelError) as caught:
        await provider.complete(MESSAGES)

    error = caught.value
    assert error.permanent is False
    assert error.status == 500
    assert "3 attempts" in str(error)
    assert "HTTP 500" in str(error)
    assert "The server had an error" in str(error)
    assert len(fake.completions) == 3
    assert len(sleeps.delays) == 2
    assert provider.calls == 0


def test_backoff_grows_with_jitter() -> None:
    for retry in range(6):
        nominal = min(30.0, 0.5 * 2**retry)
        samples = {_BACKOFF.delay(retry) for _ in range(200)}
        assert all(nominal / 2 <= delay <= nominal for delay in samples)
        assert len(samples) > 1  # jittered: concurrent agents do not retry in lockstep
    assert max(_BACKOFF.delay(20) for _ in range(50)) <= 30.0


async def test_connection_refused_is_retried_then_reported(refused_port: int, sleeps: RecordingSleep) -> None:
    base_url = f"http://127.0.0.1:{refused_port}/v1"
    async with OpenAIProvider(
        ModelConfig(base_url=base_url, name=MODEL, max_retries=2, timeout_seconds=5), sleep=sleeps
    ) as provider:
        with pytest.raises(ModelError) as caught:
            await provider.complete(MESSAGES)

    error = caught.value
    assert error.permanent is False
    assert error.status is None
    assert f"could not connect to {base_url}" in str(error)
    assert "3 attempts" in str(error)
    assert len(sleeps.delays) == 2
    assert provider.attempts == 3


async def test_hanging_server_times_out(fake: FakeOpenAI, make: Make, sleeps: RecordingSleep) -> None:
    fake.script(Hang())
    provider = make(timeout_seconds=0.5, max_retries=0)

    with pytest.raises(ModelError) as caught:
        await provider.complete(MESSAGES)

    assert caught.value.permanent is False
    assert "no answer within 0.5 s" in str(caught.value)
    assert "after 1 attempt " in str(caught.value)
    assert len(fake.completions) == 1
    assert sleeps.delays == []


async def test_hanging_then_answering_server_is_retried(fake: FakeOpenAI, make: Make, sleeps: RecordingSleep) -> None:
    fake.script(Hang(), Completion(content="awake"))

    reply = await make(timeout_seconds=0.5, max_retries=1).complete(MESSAGES)

    assert reply.content == "awake"
    assert len(fake.completions) == 2
    assert len(sleeps.delays) == 1


# --------------------------------------------------------------------------- permanent errors


@pytest.mark.parametrize(
    ("api_key", "says"),
    [("sk-wrong-key-999", "rejected the API key (HTTP 401)"), ("", "requires an API key (HTTP 401) and none is set")],
)
async def test_401_is_permanent_and_not_retried(
    fake: FakeOpenAI, make: Make, sleeps: RecordingSleep, api_key: str, says: str
) -> None:
    with pytest.raises(ModelError) as caught:
        await make(api_key=api_key).complete(MESSAGES)

    error = caught.value
    assert error.permanent is True
    assert error.status == 401
    assert says in str(error)
    assert "KAZMA_MODEL_API_KEY" in str(error)
    assert fake.base_url in str(error)
    assert len(fake.completions) == 1
    assert sleeps.delays == []
    if api_key:
        assert api_key not in str(error)


async def test_403_is_permanent(fake: FakeOpenAI, make: Make) -> None:
    fake.script(HttpError(403, {"error": {"message": "Project does not have access", "type": "forbidden"}}))

    with pytest.raises(ModelError) as caught:
        await make().complete(MESSAGES)

    assert caught.value.permanent is True
    assert caught.value.status == 403
    assert "rejected the API key (HTTP 403)" in str(caught.value)
    assert len(fake.completions) == 1


async def test_unknown_model_is_permanent_and_named(fake: FakeOpenAI, make: Make, sleeps: RecordingSleep) -> None:
    with pytest.raises(ModelError) as caught:
        await make(name="llama-does-not-exist").complete(MESSAGES)

    error = caught.value
    assert error.permanent is True
    assert error.status == 404
    assert "model 'llama-does-not-exist'" in str(error)
    assert "The model `llama-does-not-exist` does not exist" in str(error)
    assert "check model.name and model.base_url" in str(error)
    assert len(fake.completions) == 1
    assert sleeps.delays == []


async def test_other_4xx_is_permanent_with_the_server_message_truncated(
    fake: FakeOpenAI, make: Make, sleeps: RecordingSleep
) -> None:
    long_message = "This model's maximum context length is 8192 tokens. " + "x" * 2000
    fake.script(HttpError(400, {"error": {"message": long_message, "type": "invalid_request_error"}}))

    with pytest.raises(ModelError) as caught:
        await make().complete(MESSAGES)

    error = caught.value
    assert error.permanent is True
    assert error.status == 400
    assert "maximum context length is 8192 tokens" in str(error)
    assert "…" in str(error)
    assert len(str(error)) < 600
    assert len(fake.completions) == 1
    assert sleeps.delays == []


async def test_garbage_body_is_a_clear_error(fake: FakeOpenAI, make: Make) -> None:
    fake.script(Garbage())

    with pytest.raises(ModelError) as caught:
        await make().complete(MESSAGES)

    assert caught.value.permanent is False
    assert "not JSON" in str(caught.value)
    assert "<html>" in str(caught.value)
    assert len(fake.completions) == 1  # the server answered; asking again would pay twice


@pytest.mark.parametrize("stream", [False, True])
async def test_a_body_that_does_not_decode_is_a_model_error_not_a_crash(
    fake: FakeOpenAI, make: Make, stream: bool
) -> None:
    # A proxy or server saying "Content-Encoding: gzip" over a body that is not: httpx raises DecodingError, which
    # is none of the transport errors the client sorted, and it left the turn as an exception nobody answered.
    fake.script(Garbage('{"choices": []}', "application/json", headers=(("Content-Encoding", "gzip"),)))
    shown: list[str] = []

    class Shown:
        def grew(self, text: str) -> None:
            shown.append(text)

        def dropped(self) -> None:
            shown.append("")

    with pytest.raises(ModelError) as caught, answer_stream.feeding(Shown() if stream else None):
        await make(stream=stream).complete(MESSAGES)

    assert caught.value.permanent is False
    assert "could not be decoded" in str(caught.value)
    assert len(fake.completions) == 1  # the server answered; asking again would pay twice


async def test_json_without_choices_is_a_clear_error(fake: FakeOpenAI, make: Make) -> None:
    fake.script(Garbage('{"object": "chat.completion", "model": "fake-model"}', "application/json"))

    with pytest.raises(ModelError) as caught:
        await make().complete(MESSAGES)

    assert caught.value.permanent is False
    assert "no 'choices'" in str(caught.value)


async def test_error_inside_a_200_is_reported(fake: FakeOpenAI, make: Make) -> None:
    fake.script(Garbage('{"error": {"message": "upstream provider overloaded", "code": 502}}', "application/json"))

    with pytest.raises(ModelError) as caught:
        await make().complete(MESSAGES)

    assert "upstream provider overloaded" in str(caught.value)


# --------------------------------------------------------------------------- logging


async def test_api_key_never_logged_nor_in_errors(
    fake: FakeOpenAI, make: Make, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    fake.script(
        HttpError(503),
        Completion(content="ok"),
        # A server echoing the key back in its error must not get it into a log or a chat message.
        HttpError(400, {"error": {"message": f"bad request from key {KEY}", "type": "invalid_request_error"}}),
    )
    provider = make()

    with capture_logs() as events:
        await provider.complete(MESSAGES)
        with pytest.raises(ModelError) as caught:
            await provider.complete(MESSAGES)
        with pytest.raises(ModelError):
            await make(api_key="sk-another-secret-key").complete(MESSAGES)

    names = {event["event"] for event in events}
    assert {"model.request", "model.retry", "model.reply", "model.error"} <= names
    assert "***" in str(caught.value)
    for secret in (KEY, "sk-another-secret-key"):
        assert secret not in str(caught.value)
        assert secret not in repr(events)
        assert secret not in caplog.text


# --------------------------------------------------------------------------- the fake's own surface


async def test_fake_lists_models_and_checks_the_key(fake: FakeOpenAI) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        ok = await client.get(f"{fake.base_url}/models", headers={"Authorization": f"Bearer {KEY}"})
        refused = await client.get(f"{fake.base_url}/models", headers={"Authorization": "Bearer nope"})

    assert ok.status_code == 200
    assert [item["id"] for item in ok.json()["data"]] == [MODEL, "other-model"]
    assert refused.status_code == 401
    assert refused.json()["error"]["message"] == "Incorrect API key provided"
    assert [request.authorization for request in fake.requests] == [f"Bearer {KEY}", "Bearer nope"]


# --------------------------------------------------------------------------- scripted provider


def test_providers_satisfy_the_protocol(fake: FakeOpenAI) -> None:
    providers: list[ModelProvider] = [
        OpenAIProvider(ModelConfig(base_url=fake.base_url, name=MODEL)),
        ScriptedProvider([]),
    ]
    assert [p.label.split()[0] for p in providers] == ["openai-compatible", "scripted"]


async def test_scripted_replays_in_order_and_records_requests() -> None:
    first = ModelReply(content="plan ready", usage=Usage(3, 4))
    second = ModelReply(
        content=None,
        tool_calls=(ToolCall(id="c1", name="shell", arguments={"command": "ls"}, raw_arguments='{"command":"ls"}'),),
        finish_reason="tool_calls",
    )
    provider = ScriptedProvider([first, second])
    conversation: list[Message] = [{"role": "user", "content": "hello"}]

    assert await provider.complete(conversation) is first
    conversation.append({"role": "assistant", "content": "plan ready"})
    assert await provider.complete(conversation, [SHELL], model="other") is second

    assert [len(request.messages) for request in provider.requests] == [1, 2]
    # Recorded as sent: appending to the caller's list afterwards does not rewrite history.
    assert provider.requests[0].messages == ({"role": "user", "content": "hello"},)
    assert provider.requests[1].tools == (SHELL,)
    assert provider.requests[1].model == "other"
    assert provider.calls == 2
    assert provider.usage_total == Usage(3, 4)
    assert provider.remaining == 0


async def test_scripted_callable_steps_see_the_messages() -> None:
    seen: list[Sequence[Message]] = []

    def echo(messages: Sequence[Message]) -> ModelReply:
        seen.append(messages)
        return ModelReply(content=f"you said: {messages[-1]['content']}")

    provider = ScriptedProvider([ModelReply(content="first"), echo])
    await provider.complete([{"role": "user", "content": "one"}])
    reply = await provider.complete([{"role": "user", "content": "one"}, {"role": "user", "content": "two"}])

    assert reply.content == "you said: two"
    assert [list(messages) for messages in seen] == [
        [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    ]


async def test_scripted_exhaustion_is_a_permanent_error() -> None:
    provider = ScriptedProvider([ModelReply(content="only one")])
    await provider.complete(MESSAGES)

    with pytest.raises(ModelError) as caught:
        await provider.complete(MESSAGES)

    assert str(caught.value) == "the scripted scenario has no more replies"
    assert caught.value.permanent is True
    assert len(provider.requests) == 2  # the unanswered request is still on record


async def test_scripted_step_may_raise_to_script_a_failing_model() -> None:
    def down(messages: Sequence[Message]) -> ModelReply:
        raise ModelError("model server down (scripted)", permanent=False)

    provider = ScriptedProvider([down, ModelReply(content="back")])

    with pytest.raises(ModelError, match="scripted"):
        await provider.complete(MESSAGES)
    assert (await provider.complete(MESSAGES)).content == "back"


def test_scripted_label_always_says_scripted() -> None:
    assert ScriptedProvider([]).label == "scripted (demo — no model is called)"
    assert "scripted" in ScriptedProvider([], label="kazma demo").label
    assert ScriptedProvider([], label="Scripted onboarding tour").label == "Scripted onboarding tour"
