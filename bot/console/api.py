"""The approvals API: ``/api/v1/approvals`` for scripts, CI jobs and agents Kazma does not run.

Machines authenticate with API tokens (``api.tokens`` in ``kazma.yaml``), sent
as ``Authorization: Bearer …``. They are a separate kind of credential from the
console's logins: a console token is refused here, and an API token cannot log
in to the console (the console only knows its own two tokens). A token's roles
say what it may do: ``approval_requester`` opens requests, follows its own and withdraws them;
``approval_viewer`` reads any request by its id (read only: it opens, decides and withdraws nothing, and its
reading is not the asker's). Every request opened or refused is
audited with the token's name (``api:<name>``); a replay is counted on its key.

A request opened here is the same kind of request an agent's tool call opens:
the same card on every platform, the same compare-and-set, the same hash. Kazma
runs nothing for it; the caller does, after ``approved`` — and should hash what
it runs against the ``hash`` returned (the Python client does).

An ``Idempotency-Key`` is decided in the store, in the transaction that opens
the request (see :mod:`kazma.bot.api_store`): the same key and body give the
same request from any replica, a replay is counted on the key rather than
audited, and another body with the key is refused (422). A token has at most
``api.tokens.<name>.max_pending`` requests pending (429 beyond). Input JSON
cannot carry is refused with 400 and a reason, never a 500: NaN and infinities,
lone surrogates, arguments nested deeper than agents may nest theirs, and a name given twice in one object.

A body is validated with the pydantic models of :mod:`kazma.bot.console.api_models`, every answer is written
through them, and ``/api/v1/openapi.json`` is generated from the same models.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import structlog
from aiohttp import hdrs, web

from kazma.approvals.card import ASKED_THROUGH_API, ON_BEHALF_OF, REASON_GIVEN
from kazma.approvals.hashing import MAX_ARGUMENT_DEPTH, args_hash, canonical_json, nesting_depth, text_hash
from kazma.approvals.model import API_REQUESTER_PREFIX, ApprovalRequest, Status, Waits
from kazma.approvals.service import ApprovalRefused, ApprovalService, RefusalWindow
from kazma.approvals.store import UnreadableRequest
from kazma.approvals.withdrawal import POLL_GRACE, Gone, by_asker
from kazma.bot.api_store import KEY_GRACE_SECONDS, ApiOpen, KeyReused, QuotaFull
from kazma.bot.console.auth import same_token
from kazma.bot.console.long_polls import LongPolls
from kazma.bot.console.services import ApprovalsServices
from kazma.config import failpoints
from kazma.config.metrics import count_failure
from kazma.config.models import DEFAULT_POLICY, KazmaConfig
from kazma.config.store.errors import simulated_failure, store_errors

log = structlog.get_logger("kazma.api")

REQUESTER = "approval_requester"
VIEWER = "approval_viewer"
MAX_WAIT = 60.0
_KEY = re.compile(r"[\x21-\x7e]{1,200}")
_REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")
# A JSON string (escapes included), and the brackets left once strings are gone: how deep a body nests,
# found before the parser recurses into it. A string left open runs to the end of the body (which is then no JSON):
# matched only when closed, every escaped quote inside an open one began another scan to the end, and 256 KiB of
# them held the event loop (every chat and every door) for minutes.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_JSON_BRACKET = re.compile(r"[\[\]{}]")
_SURROGATE = re.compile("[\ud800-\udfff]")
# ``Kazma-Wait: sync`` on a POST: the caller waits for the answer and keeps asking (GET) until it has it; the
# request is withdrawn when it stops asking for POLL_GRACE seconds, well over MAX_WAIT (its longest poll).
WAIT_HEADER = "Kazma-Wait"
# ``DELETE …?why=``: the asker says why it withdraws, in words Kazma chose (never the caller's own text).
WHY = {"interrupted": Gone.INTERRUPTED, "disconnected": Gone.DISCONNECTED, "cancelled": Gone.CANCELLED}
_WAITS_NOTE = {
    Waits.CONNECTION: "The asker waits on its open /mcp call: if the call ends, this request is withdrawn.",
    Waits.POLLING: "The asker waits for the answer: if it is interrupted or stops asking, this request is withdrawn.",
    None: "The asker may come back for the answer until the deadline; the approval page says when it last asked.",
}


@dataclass(frozen=True)
class ApiCaller:
    name: str
    roles: tuple[str, ...]

    @property
    def actor(self) -> str:
        return f"{API_REQUESTER_PREFIX}{self.name}"


def _error(status: type[web.HTTPException], message: str, headers: dict[str, str] | None = None) -> web.HTTPException:
    return status(text=json.dumps({"error": message}), content_type="application/json", headers=headers)


def caller_of(config: KazmaConfig, request: web.Request) -> ApiCaller:
    """The API token's owner, or 401. Every configured token is compared, so timing says nothing."""
    header = request.headers.get("Authorization", "")
    scheme, _, supplied = header.partition(" ")
    found: ApiCaller | None = None
    # aiohttp keeps header bytes that are not UTF-8 as surrogates: same_token compares what was sent, never a 500.
    given = supplied.strip()
    if scheme.lower() == "bearer" and given:
        for name, token in config.api.tokens.items():
            if same_token(given, token.token):
                found = ApiCaller(name, tuple(token.roles))
    if found is None:
        log.warning("api.unauthorised", path=request.path, remote=request.remote)
        raise _error(web.HTTPUnauthorized, "an API token is required", headers={"WWW-Authenticate": "Bearer"})
    return found


async def describe(service: ApprovalService, request: ApprovalRequest) -> dict[str, Any]:
    """``request`` as the API and ``/mcp`` answer it. The caller acts on "approved": an approved row Kazma itself
    would refuse to run (no decision path of Kazma sealed it, its arguments changed since, its decided audit row
    or the reviews its policy needs are missing, its decider may not approve now) is reported as what it is,
    never as an approval."""
    # The API's pydantic models: built when the API first answers, not by every start
    from kazma.bot.console.api_models import UNVERIFIED, Approval

    outcome = request.outcome()
    status = request.status.value
    decided_by = None if outcome is None or not outcome.status.human else outcome.decided_by
    decided_person = None if outcome is None or not outcome.status.human else outcome.person
    reason = None if outcome is None else outcome.reason
    if request.status is Status.APPROVED:
        problem = await service.approval_to_act_on_problem(request)
        if problem is not None:
            count_failure(problem.site)
            log.warning("api.approval_unverified", request_id=request.id, problem=problem.detail)
            status, decided_by, decided_person = UNVERIFIED, None, None
            reason = f"not an approval Kazma made ({problem.detail}); do not act on it"
    answer = Approval.model_validate(
        {
            "id": request.id,
            "status": status,
            "tool": request.tool,
            "arguments": request.args,
            "hash": request.args_hash,
            "requested_by": request.requested_by,
            "deadline": request.deadline.isoformat(),
            "decided_by": decided_by,
            "decided_person": decided_person,
            "decided_at": None if outcome is None else outcome.decided_at.isoformat(),
            "reason": reason,
            "link": service.link(request.id),
            "waits": None if request.waits is None else request.waits.value,
            "last_seen": None if request.last_seen is None else request.last_seen.isoformat(),
        }
    )
    return answer.model_dump(mode="json")


class ApprovalsApi:
    def __init__(self, services: ApprovalsServices) -> None:
        self.services = services
        self.service = services.approvals
        self.keys = services.api_keys
        self._long_polls = LongPolls(self.service, self._encoded)
        # per token: a token refused over and over (a viewer posting in a loop) must not fill the audit
        self._refusals = RefusalWindow(clock=self.service.clock)

    @property
    def config(self) -> KazmaConfig:
        return self.services.config

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/api/v1/approvals", self.create),
            web.get("/api/v1/approvals/{id}", _readable(self.read)),
            web.delete("/api/v1/approvals/{id}", _readable(self.withdraw)),
            web.get("/api/v1/openapi.json", self.openapi),
        ]

    async def _audit(self, request_id: str | None, event: str, caller: ApiCaller, detail: str) -> None:
        with contextlib.suppress(Exception):  # the service logs a failed audit itself; refusing is what matters
            await self.service.store.audit(request_id, event, actor=caller.actor, platform="api", detail=detail)

    async def _refused(self, request_id: str | None, caller: ApiCaller, detail: str) -> None:
        """Put a refusal on record: the first per token per window is audited (who tried what), the rest are
        logged and counted (``kazma_failures_total{site="api_refused_unaudited"}``), as refused presses are.

        A refusal about a request (its idempotency key reused with another body) has a window of its own per
        request: one about nothing, or about another request, must not keep it off that request's record. Such
        windows are bounded by the requests the token itself opened."""
        log.warning("api.refused", token=caller.name, request_id=request_id, reason=detail[:300])
        about = caller.actor if request_id is None else f"{caller.actor}\x00{request_id}"
        if not self._refusals.first_in_window(about):
            count_failure("api_refused_unaudited", "api")
            return
        await self._audit(request_id, "api_refused", caller, detail)

    async def create(self, request: web.Request) -> web.Response:
        caller = caller_of(self.config, request)
        body = await _json_object(request)
        waits = _waits(request)
        opened, created = await self.open_for(caller, body, request.headers.get("Idempotency-Key"), waits=waits)
        return web.json_response(await describe(self.service, opened), status=201 if created else 200)

    async def open_for(
        self, caller: ApiCaller, body: dict[str, Any], key: str | None, *, waits: Waits | None = None
    ) -> tuple[ApprovalRequest, bool]:
        """Open (or, for a known ``key``, find) the request ``body`` asks for; raises JSON HTTP errors.

        The key's row, the quota's count, the request, its card posts and its audit rows are one transaction
        (:class:`~kazma.bot.api_store.ApiOpen`): whichever replica commits first opened it, and every other
        attempt with the key reads that request.

        ``waits``: how the asker waits for the answer (an /mcp call, a polling ``--wait``); such a request is
        withdrawn when its asker goes away. None: an API caller that may come back for it until the deadline.
        """
        if REQUESTER not in caller.roles:
            await self._refused(None, caller, "asked for an approval without the requester role")
            raise _error(web.HTTPForbidden, f"the token {caller.name!r} does not have the {REQUESTER} role")
        tool, arguments, note_lines, deadline = _validated(body, caller, self.config)
        policy = _policy(body, self.config)
        if key is not None and not _KEY.fullmatch(key):
            raise _error(web.HTTPBadRequest, "Idempotency-Key must be 1-200 visible ASCII characters")
        body_hash = text_hash(canonical_json(body))
        publisher = self.service.publisher
        if publisher is None or not publisher.can_show_cards(policy or self.config.policy_name_for(tool)):
            known = None if key is None else await self.keys.find(caller.name, key)
            if known is None:
                raise _error(web.HTTPServiceUnavailable, "no platform can show an approval card now")
            return await self._replayed(caller, known, body_hash), False
        seconds = float(self.config.approvals.deadline_seconds) if deadline is None else deadline
        now = self.service.clock()
        token = self.config.api.tokens[caller.name]
        gate = ApiOpen(
            token=caller.name,
            actor=caller.actor,
            key=key,
            body_hash=body_hash,
            max_pending=token.max_pending,
            expires_at=now + seconds + KEY_GRACE_SECONDS,
            tool=tool,
            args_hash=args_hash(arguments),
            now=now,
        )
        try:
            opened, created = await self.service.open_once(
                tool,
                arguments,
                caller.actor,
                caller.actor,
                deadline=seconds,
                notes=(*note_lines, _WAITS_NOTE[waits]),
                durable=True,  # Kazma runs nothing for it: never reported as an approved call that did not run
                waits=waits,  # ... and only an /mcp call's request ends with the process holding its connection
                seen=True,
                gate=gate,
                policy=policy,
                started_by=token.owner,  # a policy's forbid_requester refuses the token's owner
            )
            if failpoints.armed and created:  # committed with its key, the caller not answered: it asks again
                try:
                    await failpoints.reached("api.open", lambda: simulated_failure(self.service.store.tables, "api"))
                except store_errors() as exc:
                    raise _OpenedUnanswered(opened.id) from exc
        except _OpenedUnanswered as exc:
            count_failure("api_open")
            log.warning("api.open_unanswered", token=caller.name, tool=tool, request_id=exc.request_id)
            retry = "ask again with the same Idempotency-Key to get it" if key is not None else "read it with GET"
            raise _error(
                web.HTTPServiceUnavailable,
                f"the request was opened ({exc.request_id}: its cards are up), but the approvals store failed before "
                f"the answer; {retry}",
            ) from None
        except ApprovalRefused as exc:
            await self._refused(None, caller, str(exc)[:300])
            raise _error(web.HTTPUnprocessableEntity, str(exc)) from None
        except KeyReused as exc:
            await self._refused(exc.request_id, caller, "idempotency key reused with another body")
            raise _error(web.HTTPUnprocessableEntity, _KEY_REUSED) from None
        except QuotaFull as exc:
            # Logged, not audited: a client retrying against a full quota must not fill the audit.
            log.warning("api.quota_full", token=caller.name, pending=exc.pending, retry_after=exc.retry_after)
            raise _error(
                web.HTTPTooManyRequests,
                f"the token {caller.name!r} already has {exc.pending} approval requests pending (at most "
                f"{token.max_pending}, api.tokens.{caller.name}.max_pending): wait until a person decides one, "
                "or withdraw one, and ask again",
                headers={"Retry-After": str(exc.retry_after)},
            ) from None
        except LookupError:
            raise _error(web.HTTPNotFound, "the request of this Idempotency-Key is gone") from None
        except store_errors() as exc:
            count_failure("api_open")
            log.warning("api.open_failed", token=caller.name, tool=tool, error=str(exc))
            raise _error(
                web.HTTPServiceUnavailable,
                "the approvals store could not record the request, so nothing was opened (no card, no key); ask again",
            ) from None
        if created:
            log.info("api.opened", request_id=opened.id, token=caller.name, tool=tool)
        else:
            log.info("api.replayed", request_id=opened.id, token=caller.name)
        return opened, created

    async def outcome_of(self, request_id: str) -> ApprovalRequest:
        """Wait until ``request_id`` ends (at the latest at its deadline) and return it."""
        return await self.service.wait_request(request_id, cancel_with_waiter=False)

    async def _replayed(self, caller: ApiCaller, known: tuple[str, str], body_hash: str) -> ApprovalRequest:
        """A known key while no card can be shown: its request still answers (read only)."""
        request_id, first_hash = known
        if first_hash != body_hash:
            await self._refused(request_id, caller, "idempotency key reused with another body")
            raise _error(web.HTTPUnprocessableEntity, _KEY_REUSED)
        existing = await self.service.store.get(request_id)
        if existing is None:
            raise _error(web.HTTPNotFound, "the request of this Idempotency-Key is gone")
        return existing

    async def _own(self, request: web.Request, caller: ApiCaller) -> ApprovalRequest:
        found = await self._found(request)
        # A token acts only on what it opened: an id learnt elsewhere (a card, a log) reads as unknown.
        if found is None or found.requested_by != caller.actor:
            raise _error(web.HTTPNotFound, "no such approval request for this token")
        return found

    async def _found(self, request: web.Request) -> ApprovalRequest | None:
        request_id = request.match_info["id"]
        return await self.service.store.get(request_id) if _REQUEST_ID.fullmatch(request_id) else None

    async def read(self, request: web.Request) -> web.Response:
        try:
            return await self._read(request)
        except UnreadableRequest:
            raise  # a row that cannot be read is named (_readable), not reported as the store failing
        except store_errors() as exc:
            # Every long-poll the store failed under (its shared wait, its description, the read after its ?wait=)
            # got aiohttp's text/plain 500: nothing a client could parse, nor tell from a bug of Kazma's.
            log.warning("api.read_failed", request_id=request.match_info.get("id"), error=str(exc))
            raise _error(
                web.HTTPServiceUnavailable, "the approvals store could not be read now, so nothing is known; ask again"
            ) from None

    async def _read(self, request: web.Request) -> web.Response:
        caller = caller_of(self.config, request)
        if REQUESTER not in caller.roles and VIEWER not in caller.roles:
            raise _error(web.HTTPForbidden, f"the token {caller.name!r} has no approvals role")
        if VIEWER in caller.roles:
            # A viewer reads any request by its id (a dashboard, a monitor): it can neither open nor end one.
            found = await self._found(request)
            if found is None:
                raise _error(web.HTTPNotFound, "no such approval request")
        else:
            found = await self._own(request, caller)
        try:
            wait = min(MAX_WAIT, max(0.0, float(request.query.get("wait", "0"))))
        except ValueError:
            raise _error(web.HTTPBadRequest, "wait must be a number of seconds") from None
        # Only the asker's own asking counts as the asker still waiting: a viewer polling a request whose asker
        # went away must not keep it from being withdrawn.
        if not found.status.final and found.requested_by == caller.actor:
            await self.service.looked(found.id)  # the approval page says when the asker last asked
        if wait > 0 and not found.status.final:
            # One wait and one description of the ended request for every long-poll of it here (LongPolls)
            try:
                body = await self._long_polls.answer_within(found.id, wait)
            except TimeoutError:
                found = await self.service.store.get(found.id) or found
            else:
                return web.Response(body=body, headers=_JSON_HEADERS)
        return web.json_response(await describe(self.service, found))

    async def _encoded(self, ended: ApprovalRequest) -> bytes:
        return json.dumps(await describe(self.service, ended)).encode()

    def polling(self, request_id: str | None = None) -> int:
        """How many long-polls of ``request_id`` (None: of any request) are open on this web server."""
        return self._long_polls.polling(request_id)

    def stop(self) -> None:
        """The web server shuts down: every open long-poll is answered now (with what is known) and ends."""
        self._long_polls.stop()

    async def withdraw(self, request: web.Request) -> web.Response:
        caller = caller_of(self.config, request)
        if REQUESTER not in caller.roles:
            raise _error(web.HTTPForbidden, f"the token {caller.name!r} does not have the {REQUESTER} role")
        found = await self._own(request, caller)
        why_given = request.query.get("why")
        why = None if why_given is None else WHY.get(why_given)
        if why_given is not None and why is None:
            raise _error(web.HTTPBadRequest, f"why must be one of: {', '.join(WHY)}")
        if why is None:
            won, _ = await self.service.cancel_asked(found.id, reason=by_asker(caller.actor))
        else:
            won, _ = await self.service.withdraw(found.id, why)
        after = await self.service.store.get(found.id) or found
        asked = "DELETE" if why is None else f"DELETE why={why_given}"
        if won:
            await self._audit(found.id, "api_withdrawn", caller, asked)
        else:  # a decision (or another ending) came first and stands: the audit says so, not "withdrawn"
            await self._audit(found.id, "api_withdraw_late", caller, f"{asked}: it was {after.status.value} already")
        return web.json_response(await describe(self.service, after))

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document())


# What json_response says of a body, as one ready mapping (a woken long-poll's answer copies it, nothing to parse)
_JSON_HEADERS = {hdrs.CONTENT_TYPE: "application/json; charset=utf-8"}
_KEY_REUSED = (
    "this Idempotency-Key was already used with a different body; send the same body to get that request, "
    "or use a new key for a new request"
)
_TOO_DEEP = f"arguments may nest at most {MAX_ARGUMENT_DEPTH} levels deep (the limit agents are held to)"


def _readable(
    handler: Callable[[web.Request], Awaitable[web.Response]],
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``handler``, answering a request row that cannot be read (a text not UTF-8, written around Kazma) with a
    JSON 500 that names it, never SQLite's traceback: such a row is no approval, and the caller must not act."""

    @functools.wraps(handler)
    async def answer(request: web.Request) -> web.Response:
        try:
            return await handler(request)
        except UnreadableRequest as exc:
            log.warning("api.request_unreadable", request_id=exc.request_id, columns=list(exc.columns))
            raise _error(web.HTTPInternalServerError, f"{exc}; do not act on it") from None

    return answer


class _OpenedUnanswered(Exception):
    """The request was committed (cards, key and all), then the store failed before the caller was answered."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id)
        self.request_id = request_id


class _NotJson(ValueError):
    """A number JSON cannot carry (NaN, an infinity, or one too big to be finite)."""


class _Ambiguous(ValueError):
    """An object naming one member twice: parsers differ on which value counts (Python's keeps the last)."""


def _members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, value in pairs:
        if name in found:
            raise _Ambiguous(f"{name[:100]!r} is named twice in one object")
        found[name] = value
    return found


def ambiguity(body: bytes, *, read_from_text: Collection[str] = ()) -> str | None:
    """Why ``body`` (JSON naming a member twice in one object) is ambiguous, or None: for a door whose parser is
    not this module's (``/mcp``, behind the MCP SDK, which keeps the last value). A body that is not JSON at all is
    that parser's to refuse, in its own words.

    ``read_from_text``: the tool parameters a JSON-RPC ``tools/call`` may send as text that the SDK then reads as
    JSON (with Python's parser, which keeps the last value too): such a text is held to the same rule."""
    try:
        message = json.loads(body, object_pairs_hook=_members)
    except _Ambiguous as exc:
        return f"the body is ambiguous: {exc}; send each name once"
    except (ValueError, RecursionError):
        return None
    for name, text in _texts_of(message, read_from_text):
        try:
            json.loads(text, object_pairs_hook=_members)
        except _Ambiguous as exc:
            return f"the body is ambiguous: {exc} (in the text given as {name[:100]}); send each name once"
        except (ValueError, RecursionError):
            continue  # not JSON: the SDK passes it on as text, for the tool's own validation to refuse
    return None


def _texts_of(message: Any, names: Collection[str]) -> list[tuple[str, str]]:
    """The text values ``message`` (a ``tools/call``) gives the tool parameters ``names``."""
    if not isinstance(message, dict) or message.get("method") != "tools/call":
        return []
    params = message.get("params")
    given = params.get("arguments") if isinstance(params, dict) else None
    if not isinstance(given, dict):
        return []
    return [(name, value) for name, value in given.items() if name in names and isinstance(value, str)]


def _no_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotJson(f"{text} is too large to be a finite number")
    return value


def _depth_of(text: str) -> int:
    """How deeply ``text`` nests arrays and objects, read without parsing it (so no depth can crash it)."""
    steps = [1 if b in "[{" else -1 for b in _JSON_BRACKET.findall(_JSON_STRING.sub("", text))]
    return max(accumulate(steps), default=0)


async def _json_object(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        text = (await request.read()).decode("utf-8")
    except UnicodeDecodeError:
        raise _error(web.HTTPBadRequest, "the body must be a JSON object in UTF-8") from None
    except web.HTTPRequestEntityTooLarge:
        # aiohttp's own answer is plain text; every answer of this API is JSON that says what to change
        limit = request.client_max_size
        said = f"the body is larger than the {limit // 1024} KiB a request may be: send smaller arguments"
        raise web.HTTPRequestEntityTooLarge(
            max_size=limit, text=json.dumps({"error": said}), content_type="application/json"
        ) from None
    # The body is an object, so its arguments' levels are one fewer than the body's.
    if _depth_of(text) - 1 > MAX_ARGUMENT_DEPTH:
        raise _error(web.HTTPBadRequest, f"the body nests too deeply: {_TOO_DEEP}")
    try:
        body = json.loads(text, parse_constant=_no_constant, parse_float=_finite, object_pairs_hook=_members)
    except _NotJson as exc:
        raise _error(web.HTTPBadRequest, f"the body is not valid JSON: {exc}") from None
    except _Ambiguous as exc:
        # The card, the hash and the answer would show the last value, a caller's own parser may run the first.
        raise _error(web.HTTPBadRequest, f"the body is ambiguous: {exc}; send each name once") from None
    except RecursionError:
        raise _error(web.HTTPBadRequest, f"the body nests too deeply: {_TOO_DEEP}") from None
    except ValueError as exc:
        raise _error(web.HTTPBadRequest, f"the body must be a JSON object: {exc}") from None
    if not isinstance(body, dict):
        raise _error(web.HTTPBadRequest, "the body must be a JSON object")
    return body


def unrepresentable(body: dict[str, Any]) -> str | None:
    """What in ``body`` JSON cannot carry faithfully (a lone surrogate, a non-finite number), or None. Walked
    without recursion: the depth is checked separately."""
    stack: list[tuple[Any, str]] = [(body, "body")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found is not None:
                return f"{path} holds a lone surrogate (\\u{ord(found.group()):04x}), which is not Unicode text"
        elif isinstance(value, float) and not math.isfinite(value):
            return f"{path} is {value!r}, not a finite number"
        elif isinstance(value, dict):
            for name, item in value.items():
                if isinstance(name, str) and _SURROGATE.search(name):
                    return f"a name in {path} holds a lone surrogate, which is not Unicode text"
                stack.append((item, f"{path}.{name}"))
        elif isinstance(value, list | tuple):
            stack.extend((item, f"{path}[{index}]") for index, item in enumerate(value))
    return None


def _waits(request: web.Request) -> Waits | None:
    given = request.headers.get(WAIT_HEADER)
    if given is None:
        return None
    if given.strip().lower() != "sync":
        raise _error(web.HTTPBadRequest, f"{WAIT_HEADER} must be 'sync' (the caller waits for the answer), or absent")
    return Waits.POLLING


def _validated(
    body: dict[str, Any], caller: ApiCaller, config: KazmaConfig
) -> tuple[str, dict[str, Any], tuple[str, ...], float | None]:
    # What JSON cannot carry first (a lone surrogate reads as a bad tool name otherwise), then the model.
    from kazma.bot.console.api_models import BodyRefused, new_approval

    problem = unrepresentable(body)
    if problem is not None:
        raise _error(web.HTTPBadRequest, f"{problem}; send it as JSON can carry it")
    try:
        asked = new_approval(body)
    except BodyRefused as exc:
        raise _error(web.HTTPBadRequest, str(exc)) from None
    if nesting_depth(asked.arguments) > MAX_ARGUMENT_DEPTH:
        raise _error(web.HTTPBadRequest, f"arguments nest too deeply: {_TOO_DEEP}")
    notes: list[str] = [f"{ASKED_THROUGH_API}{caller.actor}; Kazma does not run it, the caller does."]
    if asked.requester is not None:
        notes.append(f"{ON_BEHALF_OF}{asked.requester}")
    if asked.reason is not None:
        notes.append(f"{REASON_GIVEN}{asked.reason}")
    # The arguments as sent (the model keeps them as parsed: ints, floats, text), so the hash is of what was sent.
    return asked.tool, body.get("arguments", {}), tuple(notes), asked.deadline_seconds


def _policy(body: dict[str, Any], config: KazmaConfig) -> str | None:
    """The approvals policy a request names (``policy``), checked; None: the tool's own, else the default."""
    named = body.get("policy")
    if named is None:
        return None
    if not isinstance(named, str) or config.policy(named) is None:
        known = ", ".join([DEFAULT_POLICY, *(p for p in config.approvals.policies if p != DEFAULT_POLICY)])
        raise _error(web.HTTPBadRequest, f"policy must name a policy under approvals.policies ({known})")
    return named


_OK = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Approval"}}}}
_ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ApiError"}}}}


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The API's OpenAPI document, made when first asked for: generating its schemas from the models costs a
    start ~4 ms that nothing before the first ``GET /api/v1/openapi.json`` needs."""
    from kazma.bot.console.api_models import component_schemas

    return {
        "openapi": "3.1.0",
        "info": {"title": "Kazma approvals API", "version": "1"},
        "components": {
            "securitySchemes": {"token": {"type": "http", "scheme": "bearer"}},
            # Generated from the models the API validates and answers with (api_models): they cannot drift apart.
            "schemas": component_schemas(),
        },
        "security": [{"token": []}],
        "paths": {
            "/api/v1/approvals": {
                "post": {
                    "summary": "Ask for a human's approval of one call (a card on every platform)",
                    "parameters": [
                        {
                            "name": "Idempotency-Key",
                            "in": "header",
                            "description": "1-200 visible ASCII characters. The same key and body return the "
                            "request it opened, from any replica, until a day past that request's deadline (then the "
                            "key is forgotten); the same key with another body is refused (422).",
                            "schema": {"type": "string", "pattern": "^[\\x21-\\x7e]{1,200}$"},
                        },
                        {
                            "name": WAIT_HEADER,
                            "in": "header",
                            "description": "sync: the caller waits and keeps asking (GET); the request is withdrawn "
                            f"when it stops asking for {POLL_GRACE:g} s",
                            "schema": {"type": "string", "enum": ["sync"]},
                        },
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/NewApproval"}}},
                    },
                    "responses": {
                        "201": {"description": "opened", **_OK},
                        "200": {"description": "the request this Idempotency-Key already opened", **_OK},
                        "400": {
                            "description": "the body is not a request JSON can carry: not a JSON object, NaN or an "
                            "infinity, a lone surrogate, arguments nested deeper than "
                            f"{MAX_ARGUMENT_DEPTH} levels, a name given twice in one object, an unknown field or a "
                            "field of the wrong kind",
                            **_ERROR,
                        },
                        "401": {"description": "no valid API token", **_ERROR},
                        "403": {"description": "the token lacks the approval_requester role", **_ERROR},
                        "404": {"description": "the request this Idempotency-Key opened is gone", **_ERROR},
                        "413": {"description": "the body is larger than the web server accepts (256 KiB)", **_ERROR},
                        "422": {
                            "description": "the call cannot be shown faithfully, or the Idempotency-Key was used "
                            "with another body",
                            **_ERROR,
                        },
                        "429": {
                            "description": "the token has api.tokens.<name>.max_pending requests pending; ask again "
                            "after Retry-After seconds, once one was decided or withdrawn",
                            "headers": {"Retry-After": {"schema": {"type": "integer"}}},
                            **_ERROR,
                        },
                        "503": {
                            "description": "no platform can show an approval card now, the store could not "
                            "record the request (nothing was opened), or it failed after opening it (the error names "
                            "the request: ask again with the same Idempotency-Key)",
                            **_ERROR,
                        },
                    },
                }
            },
            "/api/v1/approvals/{id}": {
                "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "get": {
                    "summary": "The request and its outcome; ?wait=<s> (at most 60) waits for one",
                    "parameters": [{"name": "wait", "in": "query", "schema": {"type": "number", "maximum": MAX_WAIT}}],
                    "responses": {
                        "200": {"description": "the request", **_OK},
                        "403": {"description": "the token has no approvals role", **_ERROR},
                        "404": {"description": "unknown, or (without approval_viewer) not this token's", **_ERROR},
                        "503": {"description": "the approvals store could not be read: ask again", **_ERROR},
                    },
                },
                "delete": {
                    "summary": "Withdraw a pending request (it ends cancelled); ?why= says why the asker went away",
                    "parameters": [{"name": "why", "in": "query", "schema": {"type": "string", "enum": list(WHY)}}],
                    "responses": {"200": {"description": "the request", **_OK}, "400": {"description": "unknown why"}},
                },
            },
        },
    }


def register(application: web.Application, services: ApprovalsServices) -> ApprovalsApi:
    """Add the approvals API to the web server's application (``/mcp`` is served through what this returns)."""
    api = ApprovalsApi(services)
    application.add_routes(api.routes())

    async def stopping(_: web.Application) -> None:
        api.stop()  # before the server waits for open requests: each long-poll answers and ends

    application.on_shutdown.append(stopping)
    return api
