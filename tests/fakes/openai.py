"""A wire-level fake of an OpenAI-compatible server: real HTTP on 127.0.0.1, scripted answers.

It serves ``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/embeddings`` the way OpenAI
does (same JSON shapes, same error bodies for a bad key or an unknown model),
records every request (body, ``Authorization`` header) for assertions, and
answers chat completions from a queue of scripted responses:

* :class:`Completion` — a normal reply; tool-call arguments are the raw text
  to send, so a test can make the "model" emit malformed JSON;
* :class:`HttpError` — any status and body, optionally with ``Retry-After``;
* :class:`Hang` — never answers until the fake stops;
* :class:`Garbage` — HTTP 200 with a body that is not JSON.

A request with ``"stream": true`` gets its :class:`Completion` as server-sent events, as OpenAI sends one
(``data: {chunk}`` lines, the usage in a last chunk when ``stream_options.include_usage`` asks, then
``data: [DONE]``): the content in pieces of ``chunk_size`` characters (None: one piece), each tool call's
arguments in pieces of ``argument_chunk`` characters. With ``gate`` set, each content piece waits for a
:meth:`FakeOpenAI.release` first, so a test decides when the model "writes" more (``pieces_sent`` counts them).

Embeddings come from ``embed`` (text → vector), a function the test sets; ``embeddings_error``
makes the endpoint answer that status instead. With the chat queue empty it answers
with ``fallback`` when one is set, otherwise a 500 saying nothing was scripted (so a test that forgets to script fails
loudly instead of passing on a default).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

JsonDict = dict[str, Any]


@dataclass(frozen=True)
class FakeToolCall:
    name: str
    arguments: str  # sent verbatim as function.arguments
    id: str | None = None  # None: the fake makes one up


@dataclass(frozen=True)
class Completion:
    content: str | None = None
    tool_calls: tuple[FakeToolCall, ...] = ()
    finish_reason: str | None = None  # None: "tool_calls" when there are calls, else "stop"
    usage: tuple[int, int] | None = (0, 0)  # (prompt, completion); None leaves "usage" out
    model: str | None = None  # None: echo the requested model
    cost: float | None = None  # reported as usage.cost (as OpenRouter does) when set


@dataclass(frozen=True)
class HttpError:
    status: int
    body: JsonDict | str = field(default_factory=dict)  # {} → an OpenAI-style error naming the status
    retry_after: str | None = None


@dataclass(frozen=True)
class Hang:
    """Never answer; the request is released only when the fake stops (or the client gives up)."""


@dataclass(frozen=True)
class Garbage:
    body: str = "<html><body><h1>It works!</h1></body></html>"
    content_type: str = "text/html"
    headers: tuple[tuple[str, str], ...] = ()  # more headers, as sent ("Content-Encoding" a body is not in)


FakeResponse = Completion | HttpError | Hang | Garbage


@dataclass
class RecordedRequest:
    method: str
    path: str
    authorization: str | None
    raw_body: str
    body: Any  # the parsed JSON, or None when the body was not JSON
    status: int | None = None  # filled in once answered


class FakeOpenAI:
    def __init__(self, *, api_key: str | None = None, models: Sequence[str] = ("fake-model",)) -> None:
        self.api_key = api_key
        self.models = list(models)
        self.requests: list[RecordedRequest] = []
        self.fallback: FakeResponse | None = None
        # asked first for every chat completion (its JSON body): a response, or None for the queues. An answer
        # chosen by what the request says stays right when a process is killed and started again mid-script.
        self.responder: Callable[[Any], FakeResponse | None] | None = None
        self.embed: Callable[[str], list[float]] | None = None
        self.embeddings_error: int | None = None
        self._queue: deque[FakeResponse] = deque()
        # per agent: requests whose system message is one of these prompts answer from its own queue, so
        # agents running at once (the lead finishing while a sub-agent starts) cannot take each other's replies
        self._by_prompt: dict[str, deque[FakeResponse]] = {}
        self.chunk_size: int | None = None
        self.argument_chunk = 5
        # False: tool-call pieces carry no "index" (some OpenAI-compatible servers stream them so): a call is begun
        # by a piece with its id and name, and continued by pieces with neither.
        self.stream_index = True
        self.gate: asyncio.Semaphore | None = None
        self.pieces_sent = 0
        self._ids = itertools.count(1)
        self._stopped = asyncio.Event()
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._port = 0

    # ----------------------------------------------------------------- lifecycle

    @property
    def base_url(self) -> str:
        if not self._port:
            raise RuntimeError("the fake is not started")
        return f"http://127.0.0.1:{self._port}/v1"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._list_models)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/v1/embeddings", self._embeddings)
        # A short shutdown grace and cancelled handlers: a hanging request must not hold teardown.
        runner = web.AppRunner(app, shutdown_timeout=0.25, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runner = runner
        self._port = int(runner.addresses[0][1])

    async def stop(self) -> None:
        self._stopped.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeOpenAI:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # ----------------------------------------------------------------- test helpers

    def script(self, *responses: FakeResponse) -> None:
        """Queue ``responses`` for the next chat completions, in order."""
        self._queue.extend(responses)

    def script_agent(self, system_prompt: str, *responses: FakeResponse) -> None:
        """Queue ``responses`` for requests whose first (system) message is ``system_prompt``, in order."""
        self._by_prompt.setdefault(system_prompt, deque()).extend(responses)

    @property
    def pending(self) -> int:
        """Scripted responses not yet used."""
        return len(self._queue)

    @property
    def embedding_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path == "/v1/embeddings"]

    @property
    def completions(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path == "/v1/chat/completions"]

    def release(self, pieces: int = 1) -> None:
        """Let ``pieces`` more content pieces of a gated stream go."""
        if self.gate is None:
            raise RuntimeError("set gate before releasing pieces")
        for _ in range(pieces):
            self.gate.release()

    async def wait_for(self, predicate: Callable[[], bool], *, timeout: float = 5.0) -> None:
        """Wait until ``predicate()`` holds, re-checking whenever a request arrives or is answered."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(predicate)

    # ----------------------------------------------------------------- handlers

    async def _record(self, request: web.Request) -> RecordedRequest:
        raw = await request.text()
        try:
            parsed: Any = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            parsed = None
        recorded = RecordedRequest(
            method=request.method,
            path=request.path,
            authorization=request.headers.get("Authorization"),
            raw_body=raw,
            body=parsed,
        )
        self.requests.append(recorded)
        await self._notify()
        return recorded

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _answer(self, recorded: RecordedRequest, response: web.StreamResponse) -> web.StreamResponse:
        recorded.status = response.status
        await self._notify()
        return response

    def _auth_error(self, recorded: RecordedRequest) -> web.Response | None:
        if self.api_key is None or recorded.authorization == f"Bearer {self.api_key}":
            return None
        if recorded.authorization is None:
            message = (
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        else:
            message = "Incorrect API key provided"
        return _error(401, message, "invalid_request_error", code="invalid_api_key")

    async def _list_models(self, request: web.Request) -> web.StreamResponse:
        recorded = await self._record(request)
        refused = self._auth_error(recorded)
        if refused is not None:
            return await self._answer(recorded, refused)
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "fake"} for name in self.models]
        return await self._answer(recorded, web.json_response({"object": "list", "data": data}))

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        recorded = await self._record(request)
        refused = self._auth_error(recorded)
        if refused is not None:
            return await self._answer(recorded, refused)
        body = recorded.body
        if not isinstance(body, dict):
            return await self._answer(
                recorded, _error(400, "We could not parse the JSON body of your request.", "invalid_request_error")
            )
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return await self._answer(
                recorded, _error(400, "'messages' must be a non-empty array", "invalid_request_error")
            )
        model = body.get("model")
        if model not in self.models:
            return await self._answer(
                recorded,
                _error(404, f"The model `{model}` does not exist", "invalid_request_error", code="model_not_found"),
            )
        first = messages[0].get("content") if isinstance(messages[0], dict) else None
        own = self._by_prompt.get(first) if isinstance(first, str) else None
        chosen = self.responder(body) if self.responder is not None else None
        if chosen is not None:
            scripted: FakeResponse | None = chosen
        elif own is not None:
            scripted = own.popleft() if own else self.fallback
        else:
            scripted = self._queue.popleft() if self._queue else self.fallback
        if scripted is None:
            return await self._answer(recorded, _error(500, "the fake has no scripted response left", "server_error"))
        if isinstance(scripted, Hang):
            # Released by stop(); a client that gives up first disconnects and aiohttp cancels this handler.
            await self._stopped.wait()
            return await self._answer(recorded, _error(503, "the fake stopped", "server_error"))
        if isinstance(scripted, Garbage):
            return await self._answer(
                recorded,
                web.Response(
                    status=200, text=scripted.body, content_type=scripted.content_type, headers=dict(scripted.headers)
                ),
            )
        if isinstance(scripted, HttpError):
            headers = {"Retry-After": scripted.retry_after} if scripted.retry_after is not None else {}
            if isinstance(scripted.body, str):
                response = web.Response(status=scripted.status, text=scripted.body, headers=headers)
            else:
                payload = scripted.body or {
                    "error": {"message": f"scripted HTTP {scripted.status}", "type": "server_error"}
                }
                response = web.json_response(payload, status=scripted.status, headers=headers)
            return await self._answer(recorded, response)
        if body.get("stream") is True:
            return await self._stream(request, recorded, scripted, str(model), body.get("stream_options"))
        return await self._answer(recorded, web.json_response(self._completion(scripted, str(model))))

    async def _stream(
        self, request: web.Request, recorded: RecordedRequest, scripted: Completion, model: str, options: Any
    ) -> web.StreamResponse:
        answer = self._completion(scripted, model)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        recorded.status = 200
        await response.prepare(request)
        base = {
            "id": answer["id"],
            "object": "chat.completion.chunk",
            "created": answer["created"],
            "model": answer["model"],
        }

        async def send(delta: JsonDict, finish: str | None = None) -> None:
            chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        await send({"role": "assistant", "content": ""})
        content = scripted.content or ""
        size = self.chunk_size or max(1, len(content))
        for start in range(0, len(content), size):
            if self.gate is not None:
                await self.gate.acquire()
            await send({"content": content[start : start + size]})
            self.pieces_sent += 1
            await self._notify()
        calls = answer["choices"][0]["message"].get("tool_calls", [])
        for index, call in enumerate(calls):
            where = {"index": index} if self.stream_index else {}
            head = {**where, "id": call["id"], "type": "function"}
            await send({"tool_calls": [{**head, "function": {"name": call["function"]["name"], "arguments": ""}}]})
            arguments = call["function"]["arguments"]
            for start in range(0, len(arguments), self.argument_chunk):
                piece = arguments[start : start + self.argument_chunk]
                await send({"tool_calls": [{**where, "function": {"arguments": piece}}]})
        await send({}, answer["choices"][0]["finish_reason"])
        if isinstance(options, dict) and options.get("include_usage") and "usage" in answer:
            await response.write(f"data: {json.dumps({**base, 'choices': [], 'usage': answer['usage']})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        await self._notify()
        return response

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        recorded = await self._record(request)
        refused = self._auth_error(recorded)
        if refused is not None:
            return await self._answer(recorded, refused)
        if self.embeddings_error is not None:
            return await self._answer(
                recorded, _error(self.embeddings_error, "scripted embeddings failure", "server_error")
            )
        body = recorded.body
        texts = body.get("input") if isinstance(body, dict) else None
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts) or self.embed is None:
            return await self._answer(
                recorded, _error(400, "'input' must be a string or strings", "invalid_request_error")
            )
        model = body.get("model") if isinstance(body, dict) else None
        data = [{"object": "embedding", "index": i, "embedding": self.embed(t)} for i, t in enumerate(texts)]
        tokens = sum(len(t.split()) for t in texts)
        answer = {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return await self._answer(recorded, web.json_response(answer))

    def _completion(self, scripted: Completion, model: str) -> JsonDict:
        message: JsonDict = {"role": "assistant", "content": scripted.content}
        if scripted.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id or f"call_fake_{next(self._ids)}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in scripted.tool_calls
            ]
        finish = scripted.finish_reason or ("tool_calls" if scripted.tool_calls else "stop")
        answer: JsonDict = {
            "id": f"chatcmpl-fake-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": scripted.model or model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        }
        if scripted.usage is not None:
            prompt, completion = scripted.usage
            answer["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            if scripted.cost is not None:
                answer["usage"]["cost"] = scripted.cost
        return answer


def _error(status: int, message: str, kind: str, *, code: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": code}}, status=status)
