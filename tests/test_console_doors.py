"""Every door of the web server, walked over real HTTP: the routes the running application serves are exactly
the ones the doors table declares, and each refuses the roles it must — anonymous, a shared token's read-only
session (the reader token's and the operator token's alike), a proven person who is no operator, an operator
(a person signed in with a passkey), API token.

A route added without a role fails here twice: the served routes no longer equal the table, and the server
refuses to start with it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kazma.approvals.model import Status
from kazma.bot.console import api as api_module
from kazma.bot.console import doors as doors_module
from kazma.bot.console import server as server_module
from kazma.bot.console.doors import DOORS, TABLE, Access, Door, routes_of
from kazma.bot.console.server import WebServer
from tests.test_web_server import OPERATOR, READER, Console, console

API_TOKEN = "api-token-for-the-door-walk-0123456789"
API = f"api:\n  tokens:\n    ci: {{token: '{API_TOKEN}', roles: [approval_requester]}}\n"
REQUEST_ID = "abcdefghijklmnopqrstuvwx"
PARAMS = {"id": REQUEST_ID, "conversation": "web:console", "action": "cancel", "token": "x" * 43}
LOGIN_REQUIRED = "Your session has ended; log in again."


def concrete(door: Door) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: PARAMS[m.group(1)], door.path)


def methods(door: Door) -> Iterator[str]:
    if door.method == "*":
        yield from ("GET", "POST", "DELETE")
    elif door.method == "GET":
        yield from ("GET", "HEAD")
    else:
        yield door.method


@dataclass
class Answer:
    status: int
    location: str | None
    body: str


async def ask(
    client: aiohttp.ClientSession,
    con: Console,
    method: str,
    door: Door,
    *,
    data: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> Answer:
    # an event stream is only opened: its status and headers say whether the door let the request in
    async with client.request(
        method, con.base + concrete(door), data=data, headers=headers, allow_redirects=False
    ) as response:
        streaming = response.headers.get("Content-Type", "").startswith("text/event-stream")
        body = "" if streaming or method == "HEAD" else await response.text()
        return Answer(response.status, response.headers.get("Location"), body)


def assert_login_demanded(door: Door, method: str, answer: Answer) -> None:
    where = f"{method} {door.path}"
    if door.method != "GET":
        assert answer.status == 401, where
        if method != "HEAD":
            assert LOGIN_REQUIRED in answer.body, where
    elif door.path == "/events":
        assert answer.status == 401, where
        if method != "HEAD":
            assert '"login required"' in answer.body, where
    else:
        # off to the sign-in page, which leads back to the page asked for once signed in
        assert answer.status == 302, where
        assert (answer.location or "").partition("?")[0] == "/login", where


def assert_let_in(door: Door, method: str, answer: Answer) -> None:
    """Past the door: whatever the handler then says (200, 303, 400, 404), it is not a refusal of the role."""
    where = f"{method} {door.path}: {answer.status} {answer.body[:200]}"
    assert answer.status not in (401, 403), where
    assert (answer.status, answer.location) != (302, "/login"), where


async def logged_in(con: Console, client: aiohttp.ClientSession, token: str) -> str:
    return await con.login(client, "alice" if token == OPERATOR else "rita", token)


SHARED_TOKENS = ((READER, "rita"), (OPERATOR, "olga"))  # both open read-only sessions


def test_every_door_is_declared_once_with_a_known_role() -> None:
    assert len(TABLE) == len(DOORS)
    assert {d.access for d in DOORS} == set(Access)
    for door in DOORS:
        assert door.path.startswith("/"), door
        assert door.method in ("GET", "POST", "DELETE", "*"), door
        assert door.what, door


async def test_the_served_routes_are_exactly_the_declared_doors(tmp_path: Path) -> None:
    async with console(tmp_path, extra=API) as con:
        application = con.server.application
        assert application is not None
        assert routes_of(application.router) == set(TABLE)


async def test_a_route_without_a_declared_role_stops_the_server_from_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = api_module.register

    def with_a_new_route(application: web.Application, app: object) -> object:
        async def handler(request: web.Request) -> web.Response:
            return web.Response(text="nobody said who may see this")

        application.router.add_get("/debug/everything", handler)
        return original(application, app)  # type: ignore[arg-type]

    async with console(tmp_path) as con:
        monkeypatch.setattr(server_module, "register_api", with_a_new_route)
        another = WebServer(
            con.app.console, con.web, host="127.0.0.1", port=0, token_path=tmp_path / "t", operator_token=OPERATOR,
            reader_token=READER,
        )  # fmt: skip
        with pytest.raises(RuntimeError, match=r"routes without a declared role.*GET /debug/everything"):
            await another.start()
        with pytest.raises(RuntimeError, match="not started"):
            _ = another.url

    # and a console handler the table does not name is refused at registration
    async def new(request: web.Request) -> web.Response:
        return web.Response()

    with pytest.raises(RuntimeError, match="POST /console/new"):
        doors_module.add_routes(web.Application(), {("POST", "/console/new"): new})


async def test_every_door_refuses_the_roles_it_must(tmp_path: Path) -> None:
    async with console(tmp_path, extra=API) as con:
        request = await con.open_approval({"command": "rm -rf /srv"})
        session_doors = [d for d in DOORS if d.access in (Access.READER, Access.PERSON, Access.OPERATOR)]

        # -- anonymous: every door that needs a login demands one; the open ones answer
        async with con.client() as anonymous:
            for door in DOORS:
                for method in methods(door):
                    answer = await ask(anonymous, con, method, door, data={"csrf": "x"})
                    if door.access is Access.ANONYMOUS:
                        assert answer.status != 401, (method, door.path)
                        assert answer.location != "/login", (method, door.path)
                    elif door.access is Access.API_TOKEN:
                        assert answer.status == 401, (method, door.path)
                    else:
                        assert_login_demanded(door, method, answer)

        # -- a shared token, the reader's or the operator's: reading doors open, every door of a person or an
        # operator refused (with a correct CSRF token, so the role is what refuses), and no API door opens for a
        # console session
        for token, name in SHARED_TOKENS:
            for door in session_doors + [d for d in DOORS if d.access is Access.API_TOKEN]:
                for method in methods(door):
                    async with con.client() as reader:
                        csrf = await con.login_with_token(reader, name, token)
                        data = {"csrf": csrf, "text": "/plan"} if method == "POST" else None
                        answer = await ask(reader, con, method, door, data=data)
                        if door.access in (Access.PERSON, Access.OPERATOR):
                            assert answer.status == 403, (method, door.path, answer.status)
                            assert f"operators only: web:{name} is a reader (a shared token reads only" in (
                                answer.body
                            ), door.path
                        elif door.access is Access.API_TOKEN:
                            assert answer.status == 401, (method, door.path)
                        else:
                            assert_let_in(door, method, answer)

        # -- a proven person who is no operator (bob: a passkey, not in approvals.approvers): reading doors and a
        # person's doors open (the approvals service then refuses his press), operator doors refused
        for door in session_doors:
            for method in methods(door):
                async with con.client() as person:
                    csrf = await con.login(person, "bob", OPERATOR)
                    data = {"csrf": csrf, "text": "/plan"} if method == "POST" else None
                    answer = await ask(person, con, method, door, data=data)
                    if door.access is Access.OPERATOR:
                        assert answer.status == 403, (method, door.path, answer.status)
                        assert "operators only: bob (web:bob, passkey) is a reader" in answer.body, door.path
                    else:
                        assert_let_in(door, method, answer)

        # -- an operator: every session door opens with the session's CSRF token and refuses a POST without it;
        # an operator's console session is no API token
        for door in session_doors + [d for d in DOORS if d.access is Access.API_TOKEN]:
            for method in methods(door):
                async with con.client() as operator:
                    csrf = await logged_in(con, operator, OPERATOR)
                    if door.access is Access.API_TOKEN:
                        assert (await ask(operator, con, method, door, data={"csrf": csrf})).status == 401
                        continue
                    if method == "POST":
                        forged = await ask(operator, con, method, door, data={"csrf": "not-the-token"})
                        assert forged.status == 403, door.path
                        assert "missing or wrong CSRF token" in forged.body, door.path
                        bare = await ask(operator, con, method, door, data={})
                        assert bare.status == 403, door.path
                    # the token in the field and the header: the upload reads it from either, before any file
                    answer = await ask(
                        operator,
                        con,
                        method,
                        door,
                        data={"csrf": csrf} if method == "POST" else None,
                        headers={"X-CSRF-Token": csrf} if method == "POST" else None,
                    )
                    assert_let_in(door, method, answer)

        # -- API tokens: a missing, wrong or console token is refused; the configured one is let in
        for door in (d for d in DOORS if d.access is Access.API_TOKEN):
            for method in methods(door):
                async with aiohttp.ClientSession() as machine:
                    for wrong in ("", "Bearer ", f"Bearer {API_TOKEN}x", f"Bearer {OPERATOR}", f"Basic {API_TOKEN}"):
                        headers = {"Authorization": wrong} if wrong else None
                        answer = await ask(machine, con, method, door, headers=headers)
                        assert answer.status == 401, (method, door.path, wrong)
                    right = await ask(machine, con, method, door, headers={"Authorization": f"Bearer {API_TOKEN}"})
                    assert right.status != 401, (method, door.path, right.body[:200])

        row = await con.app.service.store.get(request.id)
        assert row is not None
        assert row.status is Status.PENDING  # nobody who was refused decided anything
