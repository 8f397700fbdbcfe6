"""The approvals API and `kazma approvals request`: one card, one decision, for callers Kazma does not run."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from kazma.adapters.pacing import ChatRateLimiter
from kazma.approvals.hashing import args_hash
from kazma.bot.api_store import IdempotencyKeys
from kazma.bot.console.api import openapi_document
from kazma.config import failpoints
from kazma.config.metrics import failure_count
from tests.api_support import (
    OPERATOR_TOKEN,
    OTHER_TOKEN,
    REQUESTER_TOKEN,
    TG_CHAT,
    VIEWER_TOKEN,
    Door,
    cards,
    kazma_door,
)
from tests.mcp_support import TG_ADMIN
from tests.store_backends import Engine, rename_table

DEPLOY: dict[str, Any] = {"tool": "deploy", "arguments": {"env": "prod", "version": 42}, "reason": "release 42"}


def client(door: Door, token: str | None = REQUESTER_TOKEN) -> httpx.AsyncClient:
    headers = {} if token is None else door.auth(token)
    return httpx.AsyncClient(base_url=door.url, headers=headers, timeout=30, trust_env=False)


async def test_a_request_shows_a_card_and_a_press_decides_it(tmp_path: Path) -> None:
    async with kazma_door(tmp_path, extra=f"people: {{alice: {{telegram: {TG_ADMIN}}}}}") as door, client(door) as http:
        opened = await http.post("/api/v1/approvals", json=DEPLOY)
        assert opened.status_code == 201
        body = opened.json()
        assert body["status"] == "pending"
        assert body["hash"] == args_hash(DEPLOY["arguments"])
        await door.telegram.wait_until(lambda: bool(cards(door.telegram)), timeout=20)
        card = cards(door.telegram)[-1]
        assert "deploy" in card
        assert body["hash"] in card
        assert "release 42" in card
        assert "api:ci" in card
        waiting = asyncio.create_task(http.get(f"/api/v1/approvals/{body['id']}", params={"wait": "20"}))
        await door.press("a")
        decided = (await waiting).json()
        assert decided["status"] == "approved"
        assert decided["decided_by"] == "telegram:111"
        assert decided["decided_person"] == "alice"  # the API names the person beside the identity
        events = await door.app.service.store.events(body["id"])
        assert any(e.event == "api_opened" and e.actor == "api:ci" for e in events)


async def test_the_same_idempotency_key_gives_one_request_and_one_card(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door, client(door) as http:
        headers = {"Idempotency-Key": "job-7-attempt"}
        first, second = await asyncio.gather(
            http.post("/api/v1/approvals", json=DEPLOY, headers=headers),
            http.post("/api/v1/approvals", json=DEPLOY, headers=headers),
        )
        assert sorted([first.status_code, second.status_code]) == [200, 201]
        assert first.json()["id"] == second.json()["id"]
        await door.telegram.wait_until(lambda: bool(cards(door.telegram)), timeout=20)
        await asyncio.sleep(0)  # nothing to wait for: a second card would already be queued with the first
        assert len(await door.app.service.store.requests(limit=10)) == 1
        assert len(cards(door.telegram)) == 1
        # attack: the key replayed with another call is refused, not mapped onto the approved one
        other = {**DEPLOY, "arguments": {"env": "prod", "version": 43}}
        reused = await http.post("/api/v1/approvals", json=other, headers=headers)
        assert reused.status_code == 422


async def test_roles_and_credentials_stay_apart(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door:
        async with client(door, VIEWER_TOKEN) as viewer:
            refused = await viewer.post("/api/v1/approvals", json=DEPLOY)
            assert refused.status_code == 403
        async with client(door, OPERATOR_TOKEN) as console_token:
            assert (await console_token.post("/api/v1/approvals", json=DEPLOY)).status_code == 401
        async with client(door, None) as anonymous:
            assert (await anonymous.post("/api/v1/approvals", json=DEPLOY)).status_code == 401
            # an API token is no console login
            form = await anonymous.get("/login")
            csrf = form.cookies.get("kazma_login_csrf") or ""
            login = await anonymous.post("/login", data={"csrf": csrf, "name": "mallory", "token": REQUESTER_TOKEN})
            assert login.status_code == 401
            assert "kazma_session" not in login.cookies
        assert await door.app.service.store.requests(limit=10) == []


@pytest.mark.parametrize("path", ["/api/v1/approvals", "/mcp"])
async def test_attack_a_bearer_token_that_is_not_utf8_is_a_401_never_a_500(tmp_path: Path, path: str) -> None:
    """aiohttp keeps such header bytes as surrogates, which the token check encoded strictly: a 500 before."""
    async with kazma_door(tmp_path) as door, client(door, None) as http:
        for supplied in (b"Bearer \xff\xfe", b"Bearer " + REQUESTER_TOKEN.encode() + b"\xff"):
            answer = await http.post(path, json=DEPLOY, headers={b"Authorization": supplied})
            assert answer.status_code == 401, answer.text
            assert answer.json() == {"error": "an API token is required"}
        assert await door.app.service.store.requests(limit=10) == []


async def test_attack_a_viewer_token_posting_over_and_over_leaves_one_audit_row_and_a_count(tmp_path: Path) -> None:
    """A token without the requester role was refused with an api_refused audit row on every attempt: a read-only
    token could grow the audit without bound. The first refusal per token per window is on record, the rest
    counted (as refused presses are)."""
    async with kazma_door(tmp_path) as door, client(door, VIEWER_TOKEN) as viewer, client(door) as ci:
        before = failure_count("api_refused_unaudited", "api")
        for _ in range(30):
            refused = await viewer.post("/api/v1/approvals", json=DEPLOY)
            assert refused.status_code == 403
            assert "does not have the approval_requester role" in refused.json()["error"]
        rows = await door.app.service.store.events(event="api_refused")
        assert [(e.actor, e.detail) for e in rows] == [
            ("api:dashboard", "asked for an approval without the requester role")
        ]
        assert failure_count("api_refused_unaudited", "api") == before + 29
        # another token's first refusal is still on record: one token cannot hide another's
        headers = {"Idempotency-Key": "deploy-44"}
        assert (await ci.post("/api/v1/approvals", json=DEPLOY, headers=headers)).status_code == 201
        other = {**DEPLOY, "reason": "release 44"}
        assert (await ci.post("/api/v1/approvals", json=other, headers=headers)).status_code == 422
        rows = await door.app.service.store.events(event="api_refused")
        assert [e.actor for e in rows] == ["api:dashboard", "api:ci"]


async def test_attack_a_refusal_does_not_hide_a_key_reused_on_another_request_from_its_audit(tmp_path: Path) -> None:
    """Refusals were audited once per token per minute, whatever they were about: a requester that reused one
    request's idempotency key with another body, then within the minute another's (arguments swapped under a key
    a reviewer trusts), left nothing on the second request's record. Each request's own refusals are on its record
    (once per window); the refusals about no request still share one row per token per window."""
    async with kazma_door(tmp_path) as door, client(door) as ci:
        opened = {}
        for key in ("deploy-45", "deploy-46"):
            body = {**DEPLOY, "reason": key}
            answer = await ci.post("/api/v1/approvals", json=body, headers={"Idempotency-Key": key})
            assert answer.status_code == 201
            opened[key] = answer.json()["id"]
        before = failure_count("api_refused_unaudited", "api")
        for key in ("deploy-45", "deploy-45", "deploy-46"):
            swapped = {**DEPLOY, "arguments": {"env": "prod", "version": 666}, "reason": key}
            answer = await ci.post("/api/v1/approvals", json=swapped, headers={"Idempotency-Key": key})
            assert answer.status_code == 422
        for key, request_id in opened.items():
            rows = await door.app.service.store.events(request_id, event="api_refused")
            assert [(e.actor, e.detail) for e in rows] == [("api:ci", "idempotency key reused with another body")], key
        assert failure_count("api_refused_unaudited", "api") == before + 1  # the second try on deploy-45


async def test_a_viewer_token_reads_any_request_and_changes_nothing(tmp_path: Path) -> None:
    """Before, a viewer could only follow requests it opened, and it may open none: it could never read anything."""
    async with kazma_door(tmp_path) as door, client(door) as ci, client(door, VIEWER_TOKEN) as viewer:
        opened = (await ci.post("/api/v1/approvals", json=DEPLOY)).json()
        path = door.app.loaded.config.store.path

        def age_last_seen() -> None:
            raw = sqlite3.connect(path, timeout=60)  # in a thread: Kazma's writer shares this event loop
            try:
                raw.execute("UPDATE approval_requests SET last_seen = 1000 WHERE id = ?", (opened["id"],))
                raw.commit()
            finally:
                raw.close()

        await asyncio.to_thread(age_last_seen)
        seen = await viewer.get(f"/api/v1/approvals/{opened['id']}")
        assert seen.status_code == 200, seen.text
        assert {k: seen.json()[k] for k in ("status", "tool", "arguments", "hash", "requested_by")} == {
            "status": "pending",
            "tool": "deploy",
            "arguments": DEPLOY["arguments"],
            "hash": opened["hash"],
            "requested_by": "api:ci",
        }
        # a viewer's reading is not the asker asking: it must not keep a deserted request alive
        row = await door.app.service.store.get(opened["id"])
        assert row is not None
        assert row.last_seen is not None
        assert row.last_seen.timestamp() == 1000
        # read only: it cannot withdraw, nor open
        assert (await viewer.delete(f"/api/v1/approvals/{opened['id']}")).status_code == 403
        assert (await viewer.post("/api/v1/approvals", json=DEPLOY)).status_code == 403
        assert (await viewer.get("/api/v1/approvals/" + "x" * 22)).status_code == 404
        waiting = asyncio.create_task(viewer.get(f"/api/v1/approvals/{opened['id']}", params={"wait": "20"}))
        await door.press("a")
        decided = (await waiting).json()
        assert (decided["status"], decided["decided_by"]) == ("approved", "telegram:111")


async def test_a_request_row_that_cannot_be_read_is_named_and_never_approved(tmp_path: Path) -> None:
    """A text not UTF-8 written into the row around Kazma: before, SQLite's error went up as a bare 500 page that
    named no row (and a viewer's listing of the table would stop at it)."""
    async with kazma_door(tmp_path) as door, client(door) as ci, client(door, VIEWER_TOKEN) as viewer:
        opened = (await ci.post("/api/v1/approvals", json=DEPLOY)).json()
        path = door.app.loaded.config.store.path

        def spoil() -> None:
            raw = sqlite3.connect(path, timeout=60)  # in a thread: Kazma's writer shares this event loop
            try:
                raw.execute("UPDATE approval_requests SET reason = CAST(X'ff64' AS TEXT) WHERE id = ?", (opened["id"],))
                raw.commit()
            finally:
                raw.close()

        await asyncio.to_thread(spoil)
        for http in (ci, viewer):
            answer = await http.get(f"/api/v1/approvals/{opened['id']}")
            assert answer.status_code == 500, answer.text
            said = answer.json()["error"]
            assert f"approval request {opened['id']} cannot be read: reason holds bytes that are not UTF-8" in said
            assert "do not act on it" in said
        withdrawn = await ci.delete(f"/api/v1/approvals/{opened['id']}")
        assert withdrawn.status_code == 500, withdrawn.text
        assert opened["id"] in withdrawn.json()["error"]


async def test_attack_a_token_cannot_read_or_withdraw_another_tokens_request(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door, client(door) as ci, client(door, OTHER_TOKEN) as other:
        opened = (await ci.post("/api/v1/approvals", json=DEPLOY)).json()
        assert (await other.get(f"/api/v1/approvals/{opened['id']}")).status_code == 404
        assert (await other.delete(f"/api/v1/approvals/{opened['id']}")).status_code == 404
        still = await ci.get(f"/api/v1/approvals/{opened['id']}")
        assert still.json()["status"] == "pending"


async def test_openapi_document_describes_the_routes(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door, client(door, None) as http:
        document = (await http.get("/api/v1/openapi.json")).json()
        assert document["openapi"].startswith("3.")
        assert {"/api/v1/approvals", "/api/v1/approvals/{id}"} <= set(document["paths"])
    # every answer is what the document says it is (the document and the answers come from the same models)
    schemas = document["components"]["schemas"]
    async with kazma_door(tmp_path / "again") as door, client(door) as http:
        opened = await http.post("/api/v1/approvals", json=DEPLOY)
        jsonschema.validate(opened.json(), schemas["Approval"])
        await door.press("a")
        decided = (await http.get(f"/api/v1/approvals/{opened.json()['id']}?wait=30")).json()
        assert decided["status"] == "approved"
        jsonschema.validate(decided, schemas["Approval"])
        refused = await http.post("/api/v1/approvals", json={"tool": "deploy", "colour": "red"})
        assert (refused.status_code, refused.json()) == (400, {"error": "unknown fields: colour"})
        jsonschema.validate(refused.json(), schemas["ApiError"])


async def test_a_long_poll_open_when_the_server_stops_is_answered_not_cut_off(tmp_path: Path) -> None:
    """Before, the poll held the stop for the whole shutdown timeout and then lost its connection unanswered."""
    async with kazma_door(tmp_path) as door, client(door) as http:
        opened = (await http.post("/api/v1/approvals", json=DEPLOY)).json()
        poll = asyncio.create_task(http.get(f"/api/v1/approvals/{opened['id']}", params={"wait": "60"}))
        assert door.server.api is not None
        while not door.server.api.polling(opened["id"]):  # the long-poll is waiting
            await asyncio.sleep(0)
        await asyncio.wait_for(door.server.stop(), 10)
        answered = await poll
        assert answered.status_code == 200
        assert answered.json()["status"] == "pending"  # what is known: the poller asks again, elsewhere or later
        assert not door.server.api.polling(opened["id"])
        async with asyncio.timeout(10):
            while opened["id"] in door.app.service._waiters.watches:  # its shared wait on the service ends with it
                await asyncio.sleep(0)


async def test_long_polls_the_store_fails_under_get_a_json_error_and_the_next_poll_an_answer(tmp_path: Path) -> None:
    """Before, each got aiohttp's text/plain 500 ("Server got itself in trouble"): nothing a client could parse."""
    async with kazma_door(tmp_path) as door, client(door) as http, client(door, VIEWER_TOKEN) as viewer:
        opened = (await http.post("/api/v1/approvals", json=DEPLOY)).json()
        url = f"/api/v1/approvals/{opened['id']}"
        assert door.server.api is not None
        polls = [asyncio.create_task(caller.get(url, params={"wait": "0.5"})) for caller in (http, viewer, http)]
        async with asyncio.timeout(10):
            while door.server.api.polling(opened["id"]) < len(polls):
                await asyncio.sleep(0.01)
        store = Engine("sqlite", str(tmp_path / "state" / "kazma.db"))
        await rename_table(store, "approval_requests", "approval_requests_away")  # the store fails from now on
        try:
            failed = await asyncio.wait_for(asyncio.gather(*polls), 10)  # their ?wait= ran out: each reads again
        finally:
            await rename_table(store, "approval_requests_away", "approval_requests")
        for answer in failed:
            assert answer.status_code == 503, answer.text
            assert "approvals store" in answer.json()["error"]
        again = await http.get(url, params={"wait": "0.1"})
        assert again.status_code == 200
        assert again.json()["status"] == "pending"


# --------------------------------------------------------------------------- kazma approvals request --wait


async def _cli(door: Door, *extra: str, then: Any = None) -> tuple[int, str]:
    proc = await door.run_cli(
        "approvals", "request", "--url", door.url, "--tool", "deploy", "--arg", "env=prod", "--wait", *extra
    )
    if then is not None:
        await then()
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode() + err.decode()


@pytest.mark.parametrize(("code", "status"), [("a", "approved"), ("d", "denied")])
async def test_cli_wait_exits_0_approved_1_denied(tmp_path: Path, code: str, status: str) -> None:
    async with kazma_door(tmp_path) as door:
        returncode, out = await _cli(door, then=lambda: door.press(code))
        assert returncode == {"approved": 0, "denied": 1}[status]
        assert status in out
        assert "request " in out


async def test_cli_wait_exits_2_on_timeout(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door:
        returncode, out = await _cli(door, "--deadline", "1")
        assert returncode == 2
        assert "timeout" in out


async def test_cli_wait_exits_3_when_cancelled(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door, client(door) as http:

        async def withdraw() -> None:
            await door.telegram.wait_until(lambda: bool(cards(door.telegram)), timeout=30)
            pending = await door.app.service.store.requests(pending_only=True, limit=1)
            assert (await http.delete(f"/api/v1/approvals/{pending[0].id}")).status_code == 200

        returncode, out = await _cli(door, then=withdraw)
        assert returncode == 3
        assert "cancelled" in out


# --------------------------------------------------------------------------- what the door refuses, and how


def _nested(depth: int) -> dict[str, Any]:
    """``{"a": {"a": … 1}}``: ``depth`` levels of objects, as agents' arguments are counted."""
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value  # type: ignore[no-any-return]


BAD_BODIES = [
    ("NaN", '{"tool": "deploy", "arguments": {"n": NaN}}', "NaN is not a JSON number"),
    ("Infinity", '{"tool": "deploy", "arguments": {"n": Infinity}}', "Infinity is not a JSON number"),
    ("-Infinity", '{"tool": "deploy", "arguments": {"n": -Infinity}}', "-Infinity is not a JSON number"),
    ("1e400", '{"tool": "deploy", "arguments": {"n": 1e400}}', "too large to be a finite number"),
    ("surrogate value", '{"tool": "deploy", "arguments": {"env": "pro\\ud800d"}}', "lone surrogate (\\ud800)"),
    ("surrogate name", '{"tool": "deploy", "arguments": {"e\\udfffnv": "prod"}}', "lone surrogate"),
    ("surrogate reason", '{"tool": "deploy", "reason": "\\udc00"}', "body.reason holds a lone surrogate"),
    ("surrogate tool", '{"tool": "dep\\ud83doy"}', "body.tool holds a lone surrogate"),
    ("5000 deep", '{"tool": "deploy", "arguments": ' + '{"a": ' * 5000 + "1" + "}" * 5001, "at most 32 levels"),
    ("5000 deep list", '{"tool": "deploy", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}", "at most 32"),
    ("33 deep", json.dumps({"tool": "deploy", "arguments": _nested(33)}), "at most 32 levels deep"),
    ("900 deep", json.dumps({"tool": "deploy", "arguments": _nested(900)}), "at most 32 levels deep"),
    ("not JSON", '{"tool": "deploy", ', "the body must be a JSON object"),
    ("not UTF-8", b'{"tool": "d\xffeploy"}', "UTF-8"),
    (
        "twice",
        '{"tool": "deploy", "arguments": {"env": "staging"}, "arguments": {"env": "prod"}}',
        "'arguments' is named",
    ),
    ("twice inside", '{"tool": "deploy", "arguments": {"env": "staging", "env": "prod"}}', "'env' is named twice"),
    ("policy not text", '{"tool": "deploy", "policy": 5}', "policy must be the name"),
    ("policy too long", json.dumps({"tool": "deploy", "policy": "p" * 65}), "at most 64 characters"),
]


@pytest.mark.parametrize(("body", "says"), [(b, s) for _, b, s in BAD_BODIES], ids=[n for n, _, _ in BAD_BODIES])
async def test_attack_input_json_cannot_carry_is_a_400_with_its_reason_never_a_500(
    tmp_path: Path, body: str | bytes, says: str
) -> None:
    async with kazma_door(tmp_path) as door, client(door) as http:
        headers = {"Content-Type": "application/json", "Idempotency-Key": "k-1"}
        answer = await http.post("/api/v1/approvals", content=body, headers=headers)
        assert answer.status_code == 400, answer.text
        assert says in answer.json()["error"]
        assert await door.app.service.store.requests(limit=10) == []
        # the door still works, and the key was not taken by the refused body
        fine = await http.post("/api/v1/approvals", json=DEPLOY, headers={"Idempotency-Key": "k-1"})
        assert fine.status_code == 201


async def test_attack_a_body_over_the_size_limit_is_a_413_in_json_that_says_so(tmp_path: Path) -> None:
    """Before, aiohttp's plain-text 413 answered it: the API's only error that was not JSON."""
    async with kazma_door(tmp_path) as door, client(door) as http:
        big = {"tool": "deploy", "arguments": {"blob": "a" * (300 * 1024)}}
        answer = await http.post("/api/v1/approvals", json=big, headers={"Idempotency-Key": "big-1"})
        assert answer.status_code == 413
        assert answer.json() == {
            "error": "the body is larger than the 256 KiB a request may be: send smaller arguments"
        }
        assert await door.app.service.store.requests(limit=10) == []
    assert "413" in openapi_document()["paths"]["/api/v1/approvals"]["post"]["responses"]


async def test_attack_an_unclosed_string_of_escaped_quotes_is_refused_at_once_not_after_minutes(
    tmp_path: Path,
) -> None:
    """Before, the depth check's string pattern began a scan to the end of the body at every escaped quote inside
    a string left open: 120 KB of them held the event loop (every chat, every door) for some 40 s, a body of the
    largest size (256 KiB, this one) for over three minutes."""
    body = '{"tool": "deploy", "arguments": {"env": "' + '\\"' * 130_000
    async with kazma_door(tmp_path) as door, client(door) as http:
        # A hang guard, not a speed bound: the server shares this loop, so the guard can only fire once the door
        # lets the loop go, minutes late before (linear now: milliseconds).
        async with asyncio.timeout(60):
            answer = await http.post("/api/v1/approvals", content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code == 400, answer.text
        assert "the body must be a JSON object" in answer.json()["error"]
        assert await door.app.service.store.requests(limit=10) == []


async def test_arguments_as_deep_as_agents_may_nest_are_accepted(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door, client(door) as http:
        answer = await http.post("/api/v1/approvals", json={"tool": "deploy", "arguments": _nested(32)})
        assert answer.status_code == 201, answer.text
        assert answer.json()["hash"] == args_hash(_nested(32))


# --------------------------------------------------------------------------- idempotency in the store


async def test_replays_are_counted_on_the_key_not_audited(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door, client(door) as http:
        headers = {"Idempotency-Key": "deploy-42"}
        first = await http.post("/api/v1/approvals", json=DEPLOY, headers=headers)
        assert first.status_code == 201
        store = door.app.service.store
        audited = len(await store.events())
        replays = [await http.post("/api/v1/approvals", json=DEPLOY, headers=headers) for _ in range(300)]
        assert {r.status_code for r in replays} == {200}
        assert {r.json()["id"] for r in replays} == {first.json()["id"]}
        new_events = [e.event for e in (await store.events())[audited:]]
        assert [e for e in new_events if e.startswith("api_")] == []  # no audit row per replay
        assert await IdempotencyKeys(door.app.stores.primary).replays("ci", "deploy-42") == 300
        assert [e.event for e in await store.events(first.json()["id"])].count("api_opened") == 1


async def test_another_body_with_a_used_key_is_a_422_that_says_so(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door, client(door) as http:
        headers = {"Idempotency-Key": "deploy-43"}
        first = await http.post("/api/v1/approvals", json=DEPLOY, headers=headers)
        other = {**DEPLOY, "reason": "release 43"}
        reused = await http.post("/api/v1/approvals", json=other, headers=headers)
        assert reused.status_code == 422
        assert "already used with a different body" in reused.json()["error"]
        refused = await door.app.service.store.events(first.json()["id"], event="api_refused")
        assert [e.detail for e in refused] == ["idempotency key reused with another body"]
        assert len(await door.app.service.store.requests(limit=10)) == 1


async def test_a_request_is_never_pending_without_its_card_posts(tmp_path: Path) -> None:
    """The request, its card posts, its key and its audit rows are one commit: when the posts cannot be
    written, nothing is opened (before, the request stayed pending with no card anywhere)."""
    async with kazma_door(tmp_path) as door, client(door) as http:
        path = door.app.loaded.config.store.path

        def write_raw(sql: str) -> None:
            # In a thread, with a wait: Kazma's writer shares this event loop, so a blocking connect here that
            # met its transaction could never see it finish ("database is locked").
            raw = sqlite3.connect(path, timeout=60)
            try:
                raw.execute(sql)
                raw.commit()
            finally:
                raw.close()

        await asyncio.to_thread(
            write_raw, "CREATE TRIGGER no_posts BEFORE INSERT ON card_outbox BEGIN SELECT RAISE(ABORT, 'no room'); END"
        )
        try:
            refused = await http.post("/api/v1/approvals", json=DEPLOY, headers={"Idempotency-Key": "k-2"})
            assert refused.status_code == 503, refused.text
            assert "nothing was opened" in refused.json()["error"]
            assert await door.app.service.store.requests(limit=10) == []
            assert await IdempotencyKeys(door.app.stores.primary).find("ci", "k-2") is None
        finally:
            await asyncio.to_thread(write_raw, "DROP TRIGGER no_posts")
        opened = await http.post("/api/v1/approvals", json=DEPLOY, headers={"Idempotency-Key": "k-2"})
        assert opened.status_code == 201
        await door.telegram.wait_until(lambda: bool(cards(door.telegram)), timeout=20)


async def test_a_store_failure_after_the_open_committed_names_the_request_instead_of_nothing_opened(
    tmp_path: Path,
) -> None:
    """The request, its cards and its key committed, then the store failed before the answer: the 503 must not
    say "nothing was opened" (a person can decide its live card); it names the request, and the same key gets it."""
    async with kazma_door(tmp_path) as door, client(door) as http:
        failpoints.arm_for_test("api.open=1*error")
        try:
            refused = await http.post("/api/v1/approvals", json=DEPLOY, headers={"Idempotency-Key": "k-3"})
        finally:
            failpoints.disarm()
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert "nothing was opened" not in error
        [opened] = await door.app.service.store.requests(limit=10)
        assert opened.id in error
        assert "same Idempotency-Key" in error
        again = await http.post("/api/v1/approvals", json=DEPLOY, headers={"Idempotency-Key": "k-3"})
        assert again.status_code == 200
        assert again.json()["id"] == opened.id


# --------------------------------------------------------------------------- quota, fairness, metrics


async def test_a_token_over_its_pending_quota_gets_429_with_retry_after(tmp_path: Path) -> None:
    async with kazma_door(tmp_path, ci=", max_pending: 3") as door, client(door) as http:
        opened = []
        for n in range(3):
            answer = await http.post("/api/v1/approvals", json={"tool": "deploy", "arguments": {"n": n}},
                                     headers={"Idempotency-Key": f"n-{n}"})  # fmt: skip
            assert answer.status_code == 201
            opened.append(answer.json()["id"])
        full = await http.post("/api/v1/approvals", json={"tool": "deploy", "arguments": {"n": 3}})
        assert full.status_code == 429
        assert 1 <= int(full.headers["Retry-After"]) <= 60
        assert "already has 3 approval requests pending" in full.json()["error"]
        assert "api.tokens.ci.max_pending" in full.json()["error"]
        # a replay is no new request: it still answers while the quota is full
        again = await http.post("/api/v1/approvals", json={"tool": "deploy", "arguments": {"n": 0}},
                                headers={"Idempotency-Key": "n-0"})  # fmt: skip
        assert (again.status_code, again.json()["id"]) == (200, opened[0])
        # another token has its own quota
        async with client(door, OTHER_TOKEN) as other:
            assert (await other.post("/api/v1/approvals", json=DEPLOY)).status_code == 201
        # one withdrawn, one more fits
        assert (await http.delete(f"/api/v1/approvals/{opened[1]}")).status_code == 200
        assert (await http.post("/api/v1/approvals", json={"tool": "deploy", "arguments": {"n": 3}})).status_code == 201
        pending = await door.app.service.store.requests(pending_only=True, limit=20)
        assert sum(r.requested_by == "api:ci" for r in pending) == 3


async def test_an_api_burst_does_not_hold_an_agents_card_behind_it(tmp_path: Path) -> None:
    """Ten API cards are queued on a paced Telegram; an agent's card (and another token's) queued after the
    first was posted goes next, not after the other nine (positions, not times, are checked)."""
    async with (
        kazma_door(tmp_path, limiter=ChatRateLimiter(min_interval=0.2)) as door,
        client(door) as http,
        client(door, OTHER_TOKEN) as other,
    ):
        for n in range(10):
            answer = await http.post("/api/v1/approvals", json={"tool": "deploy", "arguments": {"n": n}})
            assert answer.status_code == 201
        await door.telegram.wait_until(lambda: bool(cards(door.telegram)), timeout=30)
        agent = await door.app.service.open("shell", {"command": "make"}, "agent:builder", f"telegram:{TG_CHAT}")
        second = (await other.post("/api/v1/approvals", json={"tool": "deploy", "arguments": {"n": 99}})).json()
        posted_before = len(cards(door.telegram))

        def position(request_id: str) -> int:
            return next((i for i, text in enumerate(cards(door.telegram)) if request_id in text), -1)

        await door.telegram.wait_until(lambda: len(cards(door.telegram)) == 12, timeout=60)
        assert posted_before < 10  # the burst was still queued: otherwise this test proves nothing
        # at most the post in flight goes before the agent's; the other token's waits for one turn of ci's
        assert position(agent.id) <= posted_before + 1, cards(door.telegram)
        assert position(second["id"]) <= posted_before + 3, cards(door.telegram)


async def test_tool_names_made_up_by_api_callers_are_no_metrics_series(tmp_path: Path) -> None:
    async with kazma_door(tmp_path, extra="tools: {deploy: dangerous}") as door, client(door) as http:
        for n in range(5):
            answer = await http.post("/api/v1/approvals", json={"tool": f"invented-{n}-x", "arguments": {}})
            assert answer.status_code == 201
        assert (await http.post("/api/v1/approvals", json=DEPLOY)).status_code == 201
        metrics = (await http.get("/metrics")).text
        assert "invented-" not in metrics
        assert 'kazma_approvals_opened_total{tool="other"}' in metrics
        assert 'kazma_approvals_opened_total{tool="deploy"}' in metrics  # configured in tools: named


# --------------------------------------------------------------------------- remembered approvals


async def test_api_cards_offer_no_remembered_approval_and_refuse_one(tmp_path: Path) -> None:
    remember = ", remember: {enabled: true, max_seconds: 3600}"
    async with kazma_door(tmp_path, approvals=remember) as door, client(door) as http:
        agent = await door.app.service.open("shell", {"command": "make"}, "agent:builder", f"telegram:{TG_CHAT}")
        opened = (await http.post("/api/v1/approvals", json=DEPLOY)).json()

        def buttons_of(request_id: str) -> list[str]:
            return [
                str(b["callback_data"])
                for m in door.telegram.bot_messages(TG_CHAT)
                if request_id in m.text
                for b in m.buttons
            ]

        await door.telegram.wait_until(lambda: bool(buttons_of(agent.id) and buttons_of(opened["id"])), timeout=30)
        assert f"kz1:{agent.id}:r" in buttons_of(agent.id)  # an agent's call consults rules: offered
        assert [b[-1] for b in buttons_of(opened["id"])] == ["a", "d", "n"]  # the API's never does: not offered
        # a forged "approve for 1 h" press on the API card is refused and decides nothing
        card = next(m for m in door.telegram.bot_messages(TG_CHAT) if opened["id"] in m.text)
        query = door.telegram.push_callback(TG_CHAT, card.message_id, TG_ADMIN, f"kz1:{opened['id']}:r")
        await door.telegram.wait_for_answer(query, timeout=10)
        still = await door.app.service.store.get(opened["id"])
        assert still is not None
        assert still.status.value == "pending"
        assert door.app.service.rules is not None
        assert await door.app.service.rules.list() == []


async def test_an_approval_whose_arguments_were_changed_in_the_store_is_reported_unverified(tmp_path: Path) -> None:
    # Attack: a genuine, sealed approval; then its stored arguments are changed around Kazma (the seal binds their
    # hash, which is left as it was). The API hands the arguments back and the caller runs them: not "approved".
    from kazma.approvals.model import Decision
    from tests.store_backends import Engine
    from tests.test_decision_seals import forge

    async with kazma_door(tmp_path) as door, client(door) as http:
        opened = (await http.post("/api/v1/approvals", json=DEPLOY)).json()
        won = await door.app.service.decide(
            opened["id"], Decision.APPROVE, actor=f"telegram:{TG_ADMIN}", platform="telegram"
        )
        assert won.won
        found = (await http.get(f"/api/v1/approvals/{opened['id']}")).json()
        assert (found["status"], found["arguments"]) == ("approved", DEPLOY["arguments"])  # the control
        changed = json.dumps({"env": "prod", "version": 43})
        await forge(
            Engine("sqlite", str(tmp_path / "state" / "kazma.db")),
            [("UPDATE approval_requests SET args_json = ? WHERE id = ?", (changed, opened["id"]))],
            no_triggers=True,
        )
        found = (await http.get(f"/api/v1/approvals/{opened['id']}")).json()
        assert found["status"] == "unverified"
        assert found["decided_by"] is None
        assert "stored call was changed" in found["reason"]


async def test_a_row_forged_to_approved_in_the_store_is_reported_unverified_never_approved(tmp_path: Path) -> None:
    # Attack: something that can write the store sets the API request's row to approved by a real approver,
    # with the matching decided audit row. The caller acts on "approved", so the API must not say it.
    from tests.store_backends import Engine
    from tests.test_decision_seals import approve_by_hand, forge

    async with kazma_door(tmp_path) as door, client(door) as http:
        opened = (await http.post("/api/v1/approvals", json=DEPLOY)).json()
        await forge(
            Engine("sqlite", str(tmp_path / "state" / "kazma.db")), approve_by_hand(opened["id"], opened["hash"])
        )
        found = (await http.get(f"/api/v1/approvals/{opened['id']}")).json()
        assert found["status"] == "unverified"
        assert found["decided_by"] is None
        assert "not an approval Kazma made" in found["reason"]
        assert "carries no decision seal" in found["reason"]


@pytest.mark.parametrize(
    ("args", "code", "said"),
    [
        # was a ValueError traceback: json.loads read NaN, which no JSON body may carry; now the text "NaN"
        (["--arg", "v=NaN", "--url", "http://127.0.0.1:1"], 4, "could not reach Kazma at http://127.0.0.1:1: "),
        (["--deadline", "nan"], 2, "Invalid value for --deadline: expected a number of seconds, got nan"),
        (["--url", "http://[::1"], 4, "could not reach Kazma at http://[::1: "),  # httpx.InvalidURL traceback
    ],
)
def test_approvals_request_with_odd_arguments_says_what_is_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], code: int, said: str
) -> None:
    from click.testing import CliRunner

    from kazma.bot.cli.approvals_request import request
    from kazma.bot.cli.context import Context

    monkeypatch.setenv("KAZMA_API_TOKEN", "t" * 40)
    config = tmp_path / "kazma.yaml"
    config.write_text(f"store: {{path: '{tmp_path / 'k.db'}'}}\n")
    result = CliRunner().invoke(request, ["--tool", "deploy", *args], obj=Context(config))
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == code
    assert said in result.stderr, result.stderr
