"""Chaos scenarios at Kazma's doors, each on one ``kazma run`` (the rig's :class:`~tests.chaos.rig.Rig`):

- ``api``: an API client (real HTTP to the console's ``/api/v1/approvals``, with an Idempotency-Key) asks for an
  approval, retrying as a real client does after a 5xx, a dropped connection or its own timeout; a person
  approves it on Telegram; the client waits for the answer. Invariants: one request for the key across the
  restart, the client ends with the outcome or a clear error, Kazma ran nothing (the caller runs it), the
  cards end showing the outcome.
- ``inbox``: a person's message reaches the lead through Telegram's long polling, kept in the inbox before it
  is confirmed (PostgreSQL). Invariants: the lead answers it once (the fake's messages), its turn ran once
  (the model's requests), nothing is left in the inbox not taken in.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx

from tests.chaos.checker import card_violations, facts, rows
from tests.chaos.rig import (
    STEP_SECONDS,
    TG_ADMIN,
    TG_CHAT,
    History,
    Rig,
    _until,
    fakes,
    history,
    observe,
    run_restarting,
)
from tests.chaos.scenario import Cell, Judged, Scenario
from tests.contract.harness import free_port
from tests.fakes.openai import Completion

API_TOKEN: Final = "ci-" + "c" * 40
KEY: Final = "chaos-deploy-1"
BODY: Final = {"tool": "deploy", "arguments": {"build": 7}}
CLIENT_TIMEOUT: Final = 10.0  # the client's own bound on one HTTP call, after which it asks again
HELLO: Final = "@kazma say hello"
HELLO_ANSWER: Final = "Hello from the lead."
_FINAL: Final = ("approved", "denied", "timeout", "cancelled")
_NO_INBOX_ON_SQLITE: Final = (
    "one process on SQLite keeps no inbox and claims nothing (bot/app.py: inbound claims exist only among "
    "PostgreSQL replicas), so the point is never reached"
)


def base_fields(tmp: Path, cell: Cell, dsn: str | None) -> dict[str, Any]:
    """A fresh history's first fields (what :func:`~tests.chaos.rig.history` fills), for a subclass of it."""
    base = history(tmp, *cell, dsn)
    return {name: getattr(base, name) for name in ("point", "action", "store", "where", "workspace")}


def process_words(h: History) -> str:
    return "died, restarted" if h.died else "hung, killed, restarted" if h.hung else "ran on"


# -- api: the approvals API's idempotent open ------------------------------------------------------------


@dataclass
class ApiHistory(History):
    answers: list[str] = field(default_factory=list)  # each answer the client got: its status, or "dropped"
    request_id: str | None = None  # the request the client was told it opened
    final: str | None = None  # the outcome the client was given in the end
    error: str | None = None  # the last error Kazma gave the client, in its words


async def _open(s: Rig, proc: asyncio.subprocess.Process, h: ApiHistory, client: httpx.AsyncClient) -> None:
    """POST until the client holds its request's id or a clear refusal (4xx), the process ends or the bound."""
    loop = asyncio.get_running_loop()
    end = loop.time() + STEP_SECONDS
    while h.request_id is None and proc.returncode is None and loop.time() < end:
        try:
            answer = await client.post(
                f"http://127.0.0.1:{s.web_port}/api/v1/approvals", json=BODY, headers={"Idempotency-Key": KEY}
            )
        except httpx.TransportError:
            h.answers.append("dropped")
        else:
            h.answers.append(str(answer.status_code))
            if answer.status_code in (200, 201):
                h.request_id = str(answer.json()["id"])
                return
            h.error = (
                str(answer.json().get("error"))
                if answer.headers.get("content-type", "").startswith("application/json")
                else answer.text[:200]
            )
            if answer.status_code < 500:
                return  # refused: a client does not send the same thing again
        await asyncio.sleep(0.2)  # a real client's back-off before it asks again


async def _outcome(s: Rig, proc: asyncio.subprocess.Process, h: ApiHistory, client: httpx.AsyncClient) -> None:
    """Read the request (waiting at the server a few seconds a time) until it is final, the process ends or the
    bound."""
    loop = asyncio.get_running_loop()
    end = loop.time() + STEP_SECONDS
    while h.final is None and proc.returncode is None and loop.time() < end:
        try:
            answer = await client.get(
                f"http://127.0.0.1:{s.web_port}/api/v1/approvals/{h.request_id}", params={"wait": "5"}
            )
        except httpx.TransportError:
            await asyncio.sleep(0.2)
            continue
        if answer.status_code == 200 and answer.json()["status"] in _FINAL:
            h.final = str(answer.json()["status"])
        elif answer.status_code != 200:
            await asyncio.sleep(0.2)


async def _serving(s: Rig, proc: asyncio.subprocess.Process, client: httpx.AsyncClient) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + STEP_SECONDS
    while proc.returncode is None and loop.time() < end:
        with contextlib.suppress(httpx.TransportError):
            if (await client.get(f"http://127.0.0.1:{s.web_port}/api/v1/openapi.json")).status_code == 200:
                return True
        await asyncio.sleep(0.1)
    return False


async def _drive_api(s: Rig, proc: asyncio.subprocess.Process, h: History, first: bool) -> bool:
    assert isinstance(h, ApiHistory)
    headers = {"Authorization": f"Bearer {API_TOKEN}"}
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT, headers=headers, trust_env=False) as client:
        # the console listens a little after the app says it started: the client is started once it serves
        if not await _serving(s, proc, client):
            return False
        await _open(s, proc, h, client)
        if h.request_id is None:
            # refused with a clear error (4xx): the client's ending, nothing to wait for; else dead or stuck
            return proc.returncode is None and h.error is not None and h.answers[-1][:1] == "4"
        # the person approves on Telegram (a card still live after a restart is pressed as well): a request still
        # pending shows one, and the restart has ended by now what its previous life left pending
        request = h.request_id

        def pending() -> bool:
            return (request,) in rows(h, "SELECT id FROM approval_requests WHERE status = 'pending'")

        await _until(lambda: bool(s.tg_live()) or not pending(), proc, STEP_SECONDS)
        if s.tg_live():
            s.press()
            h.presses += 1
        await _outcome(s, proc, h, client)
        await _until(lambda: not s.tg_live() and not s.dc_live(), proc, STEP_SECONDS)
    return proc.returncode is None and h.final is not None and not s.tg_live() and not s.dc_live()


async def _run_api(tmp: Path, cell: Cell, dsn: str | None) -> ApiHistory:
    point, action, store = cell
    extra = f"api:\n  tokens:\n    ci: {{token: '{API_TOKEN}', roles: [approval_requester]}}\n"
    s = Rig(tmp, store=store, dsn=dsn, web_port=free_port(), extra=extra)
    h = ApiHistory(**base_fields(tmp, cell, dsn))
    async with fakes(s):
        await run_restarting(s, h, f"{point}={action}", _drive_api)
        observe(s, h)
    return h


def _judge_api(h: ApiHistory) -> Judged:
    f = facts(h)
    broken: list[str] = []
    keyed = rows(h, "SELECT request_id FROM api_idempotency")  # the only key the client sends
    asked = f.requests
    # exactly one request per key, across the restart; the one the client was told of
    if len(asked) > 1 or len(keyed) > 1:
        broken.append(f"{len(asked)} requests, {len(keyed)} key rows for one Idempotency-Key")
    if h.request_id is not None and [rid for rid, *_ in asked] != [h.request_id]:
        broken.append(f"the client was told of {h.request_id}, the store holds {[rid for rid, *_ in asked]}")
    if asked and keyed and str(keyed[0][0]) != asked[0][0]:
        broken.append("the key names another request than the one opened")
    # the client ends with the outcome, or with a clear error (and then nothing is pending for it)
    if h.final is None and not h.error:
        broken.append(f"the client got neither an outcome nor an error it can read: {h.answers}")
    for rid, status, _, _ in asked:
        if f.decided.get(rid, 0) > 1:
            broken.append(f"request {rid} decided {f.decided[rid]} times")
        if status in ("approved", "denied") and f.decided.get(rid, 0) != 1:
            broken.append(f"request {rid} is {status} without exactly one decision recorded")
        if status == "pending":
            broken.append(f"request {rid} is still pending at the end")
        if h.final is not None and status != h.final:
            broken.append(f"the client was told {h.final}, the request is {status}")
    # Kazma runs nothing for an API request (the caller runs it, after an approval it reads)
    if f.executions or f.marker_lines:
        broken.append(f"Kazma ran a tool for an API request: {f.executions}")
    broken += card_violations(h, f)
    if not h.clean_exit:
        broken.append("the last process did not stop cleanly")
    request = ", ".join(status for _, status, _, _ in asked) or "no request"
    told = f"client told {h.final}" if h.final else f"client told: {h.error}"
    return Judged(f"{process_words(h)} · {request} · {told} ({', '.join(h.answers)})", broken, h.fired)


API: Final = Scenario(name="api", points=("api.open",), drive=_run_api, judge=_judge_api)


# -- inbox: Telegram's long polling, its inbox --------------------------------------------------------------


async def _drive_inbox(s: Rig, proc: asyncio.subprocess.Process, h: History, first: bool) -> bool:
    if first:
        s.telegram.push_message(TG_CHAT, TG_ADMIN, HELLO, username="ops")
    answered = await _until(lambda: _answers(s) > 0, proc, STEP_SECONDS)
    return answered and proc.returncode is None


def _answers(s: Rig) -> int:
    return sum(HELLO_ANSWER in m.text for m in s.telegram.bot_messages(TG_CHAT))


@dataclass
class InboxHistory(History):
    taken_over: bool = False  # a process said it handed an update kept in the inbox to its handlers


async def _run_inbox(tmp: Path, cell: Cell, dsn: str | None) -> InboxHistory:
    point, action, store = cell
    s = Rig(tmp, store=store, dsn=dsn)
    h = InboxHistory(**base_fields(tmp, cell, dsn))
    async with fakes(s):
        s.model.script(Completion(content=HELLO_ANSWER))
        await run_restarting(s, h, f"{point}={action}", _drive_inbox)
        observe(s, h, ask=HELLO)
        h.taken_over = '"event": "telegram.update_taken_over"' in s.log.read_text(errors="replace")
    return h


def _judge_inbox(h: InboxHistory) -> Judged:
    broken: list[str] = []
    answers = sum(HELLO_ANSWER in text for text in h.bot_texts)
    if answers == 0:
        broken.append("the person's message was lost: the lead never answered")
    if answers > 1:
        broken.append(f"the lead answered one message {answers} times")
    if h.asked_model > 1:
        broken.append(f"the person's message was handled {h.asked_model} times")
    left = rows(
        h,
        "SELECT event_key FROM inbound_claims WHERE platform = 'telegram' AND payload IS NOT NULL AND done_at IS NULL",
    )
    if left:
        broken.append(f"updates kept in the inbox and never taken in: {[r[0] for r in left]}")
    if not h.clean_exit:
        broken.append("the last process did not stop cleanly")
    said = {0: "not answered", 1: "answered once"}.get(answers, f"answered {answers} times")
    taken = " (taken over from the inbox)" if h.taken_over else ""
    return Judged(f"{process_words(h)} · {said}{taken}", broken, h.fired)


INBOX: Final = Scenario(
    name="inbox",
    points=("telegram.inbox",),
    drive=_run_inbox,
    judge=_judge_inbox,
    left_out={"sqlite": _NO_INBOX_ON_SQLITE},
)
