"""Model providers: the OpenAI-compatible chat-completions client and the scripted stand-in.

:class:`OpenAIProvider` is the one real provider. OpenAI, Ollama, vLLM, LM
Studio and OpenRouter all serve ``POST {base_url}/chat/completions``, so one
client covers them. It retries what is worth retrying (429, 5xx, broken or
refused connections, timeouts) with exponential backoff and jitter, and turns
what is not (a bad key, an unknown model, a malformed request) into a
:class:`ModelError` a person can act on.

:class:`ScriptedProvider` replays a fixed scenario for tests and ``kazma demo``;
its label says so, so nobody mistakes a demo for a model answering.
"""

from __future__ import annotations

import asyncio
import copy
import email.utils
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import structlog

from kazma.config.backoff import Backoff
from kazma.config.models import ModelConfig
from kazma.engine import answer_stream
from kazma.engine.answer_stream import AnswerStream
from kazma.engine.types import Message, ModelError, ModelReply, ToolCall, ToolSpec, Usage

__all__ = [
    "OpenAIProvider",
    "ScriptStep",
    "ScriptedProvider",
    "ScriptedRequest",
]

log = structlog.get_logger("kazma.engine.model")

Sleep = Callable[[float], Awaitable[None]]

_BACKOFF = Backoff(base=0.5, cap=30.0)
# A server asking for a longer pause than this is better reported than waited
# for inside a chat turn: the person can retry when the quota resets.
_MAX_RETRY_AFTER_SECONDS = 120.0
_SERVER_TEXT_LIMIT = 300
_USER_AGENT = "kazma/0.1 (+openai-compatible chat completions)"


def _truncate(text: str, limit: int = _SERVER_TEXT_LIMIT) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _retry_after_seconds(value: str | None) -> float | None:
    """``Retry-After`` is either delta-seconds or an HTTP date (RFC 9110 §10.2.3)."""
    if value is None or not value.strip():
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        pass
    else:
        # float() accepts "nan" and "inf"; neither is a delay anyone meant.
        return seconds if 0.0 <= seconds < float("inf") else None
    try:
        when = email.utils.parsedate_to_datetime(value.strip())
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _server_message(response: httpx.Response) -> str:
    """The human part of an error answer, whichever of the common shapes the server uses."""
    try:
        body = response.json()
    except (ValueError, RecursionError):  # a body nested deeper than Python's parser goes is not JSON to us
        return _truncate(response.text) if response.text.strip() else ""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return _truncate(error["message"])
        if isinstance(error, str):
            return _truncate(error)
        for key in ("message", "detail"):
            if isinstance(body.get(key), str):
                return _truncate(body[key])
    return _truncate(json.dumps(body, ensure_ascii=False))


def _as_int(value: Any) -> int:
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return max(0, value)
    if isinstance(value, float) and value.is_integer():
        return max(0, int(value))
    return 0


def _cost(value: Any) -> float | None:
    """``usage.cost`` when the server reports one (OpenRouter and others do); anything else is "not said"."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    cost = float(value)
    return cost if 0.0 <= cost < float("inf") else None


def _content_text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    # Some servers answer with OpenAI's "content parts" even for plain text.
    if isinstance(content, list):
        parts = [part.get("text") for part in content if isinstance(part, dict)]
        return "".join(part for part in parts if isinstance(part, str))
    return str(content)


def _parse_arguments(raw: Any) -> tuple[dict[str, Any], str, str | None]:
    """(arguments, raw text, error). A model's arguments are untrusted text; never raise on them."""
    if isinstance(raw, dict):
        # A few servers (older Ollama builds) send the object itself instead of its JSON text.
        try:
            return raw, json.dumps(raw, ensure_ascii=False), None
        except RecursionError:
            return {}, "", "arguments are nested too deeply to read; send a flat JSON object"
    if raw is None:
        return {}, "", None
    if not isinstance(raw, str):
        text = json.dumps(raw, ensure_ascii=False)
        return {}, text, f"arguments are not a JSON object: got {type(raw).__name__} {_truncate(text, 80)}"
    if not raw.strip():
        # Servers differ on how a call without arguments is sent: "{}" or "".
        return {}, raw, None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        return {}, raw, f"arguments are not a JSON object: invalid JSON ({exc.msg} at position {exc.pos})"
    except RecursionError:
        return {}, _truncate(raw, 200), "arguments are nested too deeply to read; send a flat JSON object"
    if not isinstance(value, dict):
        kind = "array" if isinstance(value, list) else type(value).__name__
        return {}, raw, f"arguments are not a JSON object: got a JSON {kind}"
    return value, raw, None


def _parse_tool_calls(raw_calls: Any) -> tuple[ToolCall, ...]:
    if not isinstance(raw_calls, list):
        return ()
    calls: list[ToolCall] = []
    for index, item in enumerate(raw_calls):
        # Every entry becomes a ToolCall, even a broken one, so the agent can tell the model what went wrong.
        if not isinstance(item, dict):
            calls.append(
                ToolCall(
                    id=f"call_{index}",
                    name="",
                    arguments={},
                    raw_arguments=_truncate(json.dumps(item, ensure_ascii=False), 200),
                    error="the tool call is not a JSON object",
                )
            )
            continue
        raw_id = item.get("id")
        call_id = raw_id if isinstance(raw_id, str) and raw_id else f"call_{index}"
        raw_function = item.get("function")
        function: dict[str, Any] = raw_function if isinstance(raw_function, dict) else {}
        raw_name = function.get("name")
        name = raw_name if isinstance(raw_name, str) else ""
        arguments, raw_text, error = _parse_arguments(function.get("arguments"))
        if not name and error is None:
            error = "the tool call names no function"
        calls.append(ToolCall(id=call_id, name=name, arguments=arguments, raw_arguments=raw_text, error=error))
    return tuple(calls)


class _Retryable(Exception):
    """One attempt failed in a way another attempt may fix."""

    def __init__(self, reason: str, *, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.retry_after = retry_after


class OpenAIProvider:
    """A client of an OpenAI-compatible ``/chat/completions`` endpoint.

    ``calls`` counts replies received and ``usage_total`` adds up their token
    usage; ``attempts`` counts HTTP requests sent, retries included. Close it
    with :meth:`aclose` (or use it as an async context manager).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._config = config
        self._base_url = config.base_url.rstrip("/")
        self._url = f"{self._base_url}/chat/completions"
        self._transport = transport
        self._sleep = sleep
        self._client: httpx.AsyncClient | None = None
        self.usage_total = Usage()
        self.calls = 0
        self.attempts = 0

    @property
    def label(self) -> str:
        return f"openai-compatible {self._config.name} at {self._base_url}"

    @property
    def config(self) -> ModelConfig:
        return self._config

    async def __aenter__(self) -> OpenAIProvider:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _http(self) -> httpx.AsyncClient:
        # Created on first use so that constructing a provider needs no running event loop.
        if self._client is None:
            headers = {"User-Agent": _USER_AGENT, "Accept": "application/json"}
            if self._config.api_key:
                headers["Authorization"] = f"Bearer {self._config.api_key}"
            self._client = httpx.AsyncClient(
                transport=self._transport,
                timeout=httpx.Timeout(self._config.timeout_seconds),
                headers=headers,
                follow_redirects=False,
            )
        return self._client

    def _redact(self, text: str) -> str:
        # Servers sometimes echo what they were sent; the key must not reach a log or a chat message.
        key = self._config.api_key
        return text.replace(key, "***") if key else text

    async def complete(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), *, model: str | None = None
    ) -> ModelReply:
        name = model or self._config.name
        body: dict[str, Any] = {"model": name, "messages": list(messages)}
        if tools:
            body["tools"] = [tool.as_openai() for tool in tools]
            body["tool_choice"] = "auto"
        attempts = self._config.max_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                return await self._attempt(body, name, attempt=attempt, tools=len(tools))
            except _Retryable as failure:
                reason = self._redact(failure.reason)
                if attempt == attempts:
                    noun = "attempt" if attempts == 1 else "attempts"
                    message = (
                        f"the model server at {self._base_url} gave no usable answer after {attempts} {noun} "
                        f"(model {name!r}); last: {reason}"
                    )
                    log.warning(
                        "model.error",
                        model=name,
                        url=self._url,
                        attempts=attempts,
                        status=failure.status,
                        permanent=False,
                        reason=reason,
                    )
                    raise ModelError(
                        message, permanent=False, status=failure.status, retry_after=failure.retry_after
                    ) from None
                if failure.retry_after is not None and failure.retry_after > _MAX_RETRY_AFTER_SECONDS:
                    message = (
                        f"the model server at {self._base_url} is rate limiting (model {name!r}) and asks to wait "
                        f"{failure.retry_after:g} s, longer than the {_MAX_RETRY_AFTER_SECONDS:g} s Kazma waits "
                        f"inside a turn; try again later ({reason})"
                    )
                    log.warning(
                        "model.error",
                        model=name,
                        url=self._url,
                        attempts=attempt,
                        status=failure.status,
                        permanent=False,
                        reason=reason,
                        retry_after=failure.retry_after,
                    )
                    raise ModelError(
                        message, permanent=False, status=failure.status, retry_after=failure.retry_after
                    ) from None
                delay = failure.retry_after if failure.retry_after is not None else _BACKOFF.delay(attempt - 1)
                log.warning(
                    "model.retry",
                    model=name,
                    url=self._url,
                    attempt=attempt,
                    of=attempts,
                    delay=round(delay, 3),
                    status=failure.status,
                    reason=reason,
                )
                await self._sleep(delay)
        raise AssertionError("unreachable: the last attempt either returns or raises")  # pragma: no cover

    async def _attempt(self, body: dict[str, Any], name: str, *, attempt: int, tools: int) -> ModelReply:
        timeout = self._config.timeout_seconds
        log.debug(
            "model.request",
            model=name,
            url=self._url,
            attempt=attempt,
            messages=len(body["messages"]),
            tools=tools,
        )
        self.attempts += 1
        stream = answer_stream.current() if self._config.stream else None
        try:
            # httpx's timeout bounds each phase; this one bounds the whole attempt, so a server
            # trickling bytes cannot hold a turn forever.
            async with asyncio.timeout(timeout):
                if stream is None:
                    response = await self._http().post(self._url, json=body)
                else:
                    streamed = await self._streamed(body, name, stream)
                    if isinstance(streamed, ModelReply):
                        return self._received(streamed, name, attempt=attempt)
                    response = streamed
        except (httpx.TimeoutException, TimeoutError):
            raise _Retryable(f"no answer within {timeout:g} s (model.timeout_seconds)") from None
        except httpx.UnsupportedProtocol as exc:
            raise self._permanent(f"cannot call {self._url}: {exc}", name=name, status=None) from None
        except httpx.ConnectError as exc:
            raise _Retryable(f"could not connect to {self._base_url} ({str(exc) or type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise _Retryable(f"the connection failed ({type(exc).__name__}: {exc})") from None
        except httpx.DecodingError as exc:
            # The server answered (not retried: asking again would pay twice), in a body its own Content-Encoding
            # does not decode; not a transport error, and anything but a ModelError would leave the turn unanswered.
            message = self._redact(
                f"the model server at {self._base_url} answered for model {name!r}, but its body could not be "
                f"decoded ({_truncate(str(exc), 120)}): check what sits between Kazma and model.base_url"
            )
            log.warning("model.error", model=name, url=self._url, status=None, permanent=False, reason=message)
            raise ModelError(message, permanent=False) from None

        status = response.status_code
        if status >= 400:
            self._raise_for_status(response, name)
        if status >= 300:
            location = response.headers.get("location", "")
            raise self._permanent(
                f"the model server at {self._base_url} redirected (HTTP {status}) to {location or 'nowhere'}: "
                "check model.base_url",
                name=name,
                status=status,
            )
        return self._received(self._parse(response, name), name, attempt=attempt)

    def _received(self, reply: ModelReply, name: str, *, attempt: int) -> ModelReply:
        self.calls += 1
        self.usage_total = self.usage_total + reply.usage
        log.info(
            "model.reply",
            model=reply.model or name,
            attempt=attempt,
            finish_reason=reply.finish_reason,
            tool_calls=len(reply.tool_calls),
            prompt_tokens=reply.usage.prompt_tokens,
            completion_tokens=reply.usage.completion_tokens,
        )
        return reply

    async def _streamed(self, body: dict[str, Any], name: str, stream: AnswerStream) -> ModelReply | httpx.Response:
        """One attempt asked as server-sent events: the reply, assembled while its text is shown, or the
        response itself when it is not a stream (an error, a redirect, a server that ignored ``stream``)."""
        asked = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with self._http().stream("POST", self._url, json=asked) as response:
            kind = response.headers.get("content-type", "")
            if response.status_code != 200 or not kind.startswith("text/event-stream"):
                await response.aread()
                return response
            assembly = _Assembly(stream)
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # comments (": keep-alive"), event names, blank separators
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except (ValueError, RecursionError):
                    start = _truncate(data, 80)
                    raise self._broken_stream(name, f"a chunk is not JSON (it starts {start!r})") from None
                if not isinstance(chunk, dict):
                    raise self._broken_stream(name, "a chunk is not a JSON object")
                if chunk.get("error"):
                    error = chunk["error"]
                    text = error.get("message") if isinstance(error, dict) else error
                    raise self._broken_stream(name, f"it reports an error mid-answer: {_truncate(str(text))}")
                assembly.take(chunk)
            if not assembly.finished:
                raise _Retryable("the answer stream ended before the answer did")
            return assembly.reply(name)

    def _broken_stream(self, name: str, what: str) -> ModelError:
        message = self._redact(
            f"the model server at {self._base_url} streamed an answer for model {name!r}, but {what}"
        )
        log.warning("model.error", model=name, url=self._url, status=200, permanent=False, reason=message)
        return ModelError(message, permanent=False, status=200)

    def _permanent(self, message: str, *, name: str, status: int | None) -> ModelError:
        message = self._redact(message)
        log.error("model.error", model=name, url=self._url, status=status, permanent=True, reason=message)
        return ModelError(message, permanent=True, status=status)

    def _raise_for_status(self, response: httpx.Response, name: str) -> None:
        status = response.status_code
        detail = self._redact(_server_message(response))
        suffix = f": {detail}" if detail else ""
        if status == 429:
            raise _Retryable(
                f"rate limited (HTTP 429){suffix}",
                status=status,
                retry_after=_retry_after_seconds(response.headers.get("retry-after")),
            )
        if status >= 500 or status == 408:
            raise _Retryable(f"HTTP {status}{suffix}", status=status)
        if status in (401, 403):
            if self._config.api_key:
                message = (
                    f"the model server at {self._base_url} rejected the API key (HTTP {status}): "
                    "check model.api_key / KAZMA_MODEL_API_KEY"
                )
            else:
                message = (
                    f"the model server at {self._base_url} requires an API key (HTTP {status}) and none is set: "
                    "set model.api_key / KAZMA_MODEL_API_KEY"
                )
            raise self._permanent(message, name=name, status=status)
        if status == 404:
            raise self._permanent(
                f"model {name!r} or the endpoint {self._url} was not found (HTTP 404){suffix}: "
                "check model.name and model.base_url",
                name=name,
                status=status,
            )
        raise self._permanent(
            f"the model server at {self._base_url} refused the request for model {name!r} (HTTP {status}){suffix}",
            name=name,
            status=status,
        )

    def _parse(self, response: httpx.Response, name: str) -> ModelReply:
        # Not retried: the server did answer, and asking again would pay for the same tokens twice.
        def broken(what: str) -> ModelError:
            message = self._redact(
                f"the model server at {self._base_url} answered HTTP {response.status_code} for model {name!r}, "
                f"but {what}: check model.base_url points at an OpenAI-compatible /v1 endpoint"
            )
            log.warning(
                "model.error", model=name, url=self._url, status=response.status_code, permanent=False, reason=message
            )
            return ModelError(message, permanent=False, status=response.status_code)

        try:
            body = response.json()
        except ValueError:
            start = _truncate(response.text, 80)
            raise broken(f"the body is not JSON (it starts {start!r})" if start else "the body is empty") from None
        except RecursionError:
            # e.g. tool-call arguments sent as an object thousands of levels deep: an answer, not a crash
            raise broken("the body is nested too deeply to read") from None
        if not isinstance(body, dict):
            raise broken(f"the body is a JSON {type(body).__name__}, not an object with 'choices'")
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            error = body.get("error")
            if error:
                # Some gateways (OpenRouter among them) report upstream failures inside a 200.
                text = error.get("message") if isinstance(error, dict) else error
                raise broken(f"it reports an error instead of a completion: {_truncate(str(text))}")
            raise broken("it has no 'choices'")
        choice = choices[0]
        message = choice.get("message")
        if not isinstance(message, dict):
            raise broken("choices[0] has no 'message'")
        finish_reason = choice.get("finish_reason")
        raw_usage = body.get("usage")
        usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
        return ModelReply(
            content=_content_text(message.get("content")),
            tool_calls=_parse_tool_calls(message.get("tool_calls")),
            usage=Usage(
                _as_int(usage.get("prompt_tokens")), _as_int(usage.get("completion_tokens")), _cost(usage.get("cost"))
            ),
            model=str(body.get("model") or name),
            finish_reason=finish_reason if isinstance(finish_reason, str) else None,
        )


class _Assembly:
    """A streamed completion put back together: text pieces joined, each tool call's pieces joined by its
    ``index``, so the reply is the one the same server would have sent whole (and its calls are read by the same
    :func:`_parse_tool_calls`: what a card shows is what the model asked for, streamed or not)."""

    def __init__(self, stream: AnswerStream) -> None:
        self.stream = stream
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] = {}
        self.model = ""
        self.finish_reason: str | None = None
        self.finished = False
        self.shown = False  # text was handed to the stream

    def take(self, chunk: dict[str, Any]) -> None:
        if isinstance(chunk.get("model"), str) and chunk["model"]:
            self.model = chunk["model"]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return  # the usage chunk at the end has no choices
        choice = choices[0]
        if isinstance(choice.get("finish_reason"), str):
            self.finish_reason = choice["finish_reason"]
            self.finished = True
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        for piece in delta.get("tool_calls") or ():
            if isinstance(piece, dict):
                self._call_piece(piece)
        content = _content_text(delta.get("content"))
        if content:
            self.text.append(content)
            if not self.calls:  # once the model asks for tools, its words are not the answer
                self.shown = True
                self.stream.grew("".join(self.text))

    def _call_piece(self, piece: dict[str, Any]) -> None:
        index = piece.get("index")
        key = index if isinstance(index, int) and not isinstance(index, bool) else self._unindexed_key(piece)
        call = self.calls.setdefault(key, {"type": "function", "function": {"name": "", "arguments": ""}})
        if isinstance(piece.get("id"), str) and piece["id"]:
            call["id"] = piece["id"]
        function = piece.get("function")
        if not isinstance(function, dict):
            return
        sent = call["function"]
        if isinstance(function.get("name"), str) and function["name"]:
            sent["name"] = function["name"]
        arguments = function.get("arguments")
        if isinstance(arguments, str) and isinstance(sent["arguments"], str):
            sent["arguments"] += arguments
        elif arguments is not None:
            sent["arguments"] = arguments  # a server sending the object itself, as some Ollama builds do

    def _unindexed_key(self, piece: dict[str, Any]) -> int:
        """Where a piece without an ``index`` goes (servers that stream calls so): a piece that begins a call (an
        id other than the last call's, or a name when the last call has one) is a new call; any other continues
        the last call. Each piece a call of its own split one call's arguments into several broken calls."""
        if not self.calls:
            return 0
        last = max(self.calls)
        current = self.calls[last]
        piece_id = piece.get("id")
        function = piece.get("function")
        named = isinstance(function, dict) and isinstance(function.get("name"), str) and bool(function["name"])
        has_id = isinstance(piece_id, str) and bool(piece_id)
        current_id = current.get("id")
        if has_id and current_id is not None and piece_id != current_id:
            return last + 1
        if named and current["function"]["name"] and not (has_id and piece_id == current_id):
            return last + 1
        return last

    def reply(self, name: str) -> ModelReply:
        calls = _parse_tool_calls([self.calls[index] for index in sorted(self.calls)])
        if calls and self.shown:
            self.stream.dropped()
        return ModelReply(
            content="".join(self.text) if self.text else None,
            tool_calls=calls,
            usage=Usage(
                _as_int(self.usage.get("prompt_tokens")),
                _as_int(self.usage.get("completion_tokens")),
                _cost(self.usage.get("cost")),
            ),
            model=self.model or name,
            finish_reason=self.finish_reason,
        )


# --------------------------------------------------------------------------- scripted


ScriptStep = ModelReply | Callable[[Sequence[Message]], ModelReply]


@dataclass(frozen=True)
class ScriptedRequest:
    """What one ``complete`` call was given (copied, so later changes to the caller's list do not rewrite it)."""

    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...]
    model: str | None


class ScriptedProvider:
    """Replays ``script`` in order; a callable step is handed the messages and returns the reply.

    A step may raise (a :class:`ModelError`, say) to script a failing model.
    """

    def __init__(self, script: Sequence[ScriptStep], *, label: str = "scripted (demo — no model is called)") -> None:
        self._script = list(script)
        self._next = 0
        # The label is what people see; a custom one must still say no model is answering.
        self._label = label if "scripted" in label.lower() else f"scripted: {label}"
        self.requests: list[ScriptedRequest] = []
        self.usage_total = Usage()
        self.calls = 0

    @property
    def label(self) -> str:
        return self._label

    @property
    def remaining(self) -> int:
        return len(self._script) - self._next

    async def complete(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), *, model: str | None = None
    ) -> ModelReply:
        request = ScriptedRequest(tuple(copy.deepcopy(list(messages))), tuple(tools), model)
        self.requests.append(request)
        if self._next >= len(self._script):
            log.error("model.error", provider=self._label, permanent=True, reason="script exhausted")
            raise ModelError("the scripted scenario has no more replies", permanent=True)
        step = self._script[self._next]
        self._next += 1
        reply = step if isinstance(step, ModelReply) else step(request.messages)
        self.calls += 1
        self.usage_total = self.usage_total + reply.usage
        log.info(
            "model.reply",
            provider=self._label,
            step=self._next,
            finish_reason=reply.finish_reason,
            tool_calls=len(reply.tool_calls),
        )
        return reply
