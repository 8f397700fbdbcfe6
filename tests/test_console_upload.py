"""Files sent from the web console: saved into the console conversation's workspace and named to the agent, within
``files.max_bytes`` / ``files.max_count``; over a bound, or from a reader, or without the CSRF token: nothing saved."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import aiohttp

from kazma.engine.agent import workspace_for
from kazma.engine.model import ScriptStep
from kazma.engine.types import Message, ModelReply
from tests.test_web_server import OPERATOR, READER, Console, console, until

BOUNDS = "files: {max_bytes: 100, max_count: 2}\n"


def form(csrf: str | None, files: Sequence[tuple[str, bytes]], text: str = "") -> aiohttp.FormData:
    data = aiohttp.FormData()
    if csrf is not None:
        data.add_field("csrf", csrf)  # first, as the page's form sends it
    for name, content in files:
        data.add_field("files", content, filename=name, content_type="application/octet-stream")
    data.add_field("text", text)
    return data


def incoming(con: Console, tmp_path: Path) -> Path:
    return workspace_for(tmp_path / "ws", "web:console") / "incoming"


async def test_a_file_from_the_console_reaches_the_workspace_and_the_agent(tmp_path: Path) -> None:
    seen: list[str] = []

    def lead(messages: Sequence[Message]) -> ModelReply:
        seen.append(str(messages[-1]["content"]))
        return ModelReply(content="Got the notes.")

    scripts: dict[str, list[ScriptStep]] = {"kazma": [lead]}
    async with console(tmp_path, scripts=scripts, extra=BOUNDS) as con, con.client() as op:
        csrf = await con.login(op, "alice", OPERATOR)
        page = await (await op.get(f"{con.base}/")).text()
        assert 'action="/console/upload" enctype="multipart/form-data"' in page
        assert "Up to 2 files of at most 100 bytes each (files.max_count, files.max_bytes)" in page
        sent = await op.post(
            f"{con.base}/console/upload", data=form(csrf, [("notes.txt", b"hello")], "@kazma read them"),
            allow_redirects=False,
        )  # fmt: skip
        assert sent.status == 303
        await until(con.web, lambda: any(m.text == "Got the notes." for m in con.web.messages()))
        saved = incoming(con, tmp_path) / "notes.txt"
        assert saved.read_bytes() == b"hello"
        assert seen == ["@kazma read them\n\n[Files sent with this message, saved in your workspace: "
                        "incoming/notes.txt (5 bytes)]"]  # fmt: skip
        shown = await (await op.get(f"{con.base}/")).text()
        assert "📎 notes.txt (5 bytes)" in shown


async def test_over_a_bound_nothing_is_saved_and_the_sender_is_told(tmp_path: Path) -> None:
    async with console(tmp_path, extra=BOUNDS) as con, con.client() as op:
        csrf = await con.login(op, "alice", OPERATOR)
        big = await (
            await op.post(f"{con.base}/console/upload", data=form(csrf, [("ok.txt", b"x"), ("big.bin", b"y" * 101)]))
        ).text()
        assert (
            "Not saved: big.bin is larger than 100 bytes; Kazma accepts files up to 100 bytes (files.max_bytes). "
            "Nothing was saved."
        ) in big
        many = await (
            await op.post(f"{con.base}/console/upload", data=form(csrf, [("a", b"1"), ("b", b"2"), ("c", b"3")]))
        ).text()
        assert "Not saved: more than 2 files were sent at once; Kazma accepts at most 2 (files.max_count)." in many
        # an empty file input: browsers send a part with an empty file name
        none = await (await op.post(f"{con.base}/console/upload", data=form(csrf, [("", b"")], "just text"))).text()
        assert "No file was chosen; nothing was sent." in none
        plain = await op.post(f"{con.base}/console/upload", data={"csrf": csrf, "text": "x"})
        assert plain.status == 400
        assert not incoming(con, tmp_path).exists()
        assert [m for m in con.web.messages() if m.author == "web:alice"] == []  # nothing reached the agents


async def test_readers_and_forged_uploads_are_refused(tmp_path: Path) -> None:
    async with console(tmp_path, extra=BOUNDS) as con, con.client() as rd, con.client() as op:
        reader_csrf = await con.login(rd, "rita", READER)
        await con.login(op, "alice", OPERATOR)
        refused = await rd.post(f"{con.base}/console/upload", data=form(reader_csrf, [("a.txt", b"1")]))
        assert refused.status == 403
        assert "operators only" in await refused.text()
        forged = await op.post(f"{con.base}/console/upload", data=form(None, [("a.txt", b"1")]))
        assert forged.status == 403
        wrong = await op.post(f"{con.base}/console/upload", data=form("not-the-token", [("a.txt", b"1")]))
        assert wrong.status == 403
        anonymous = await aiohttp.ClientSession().post(f"{con.base}/console/upload", data=form("x", [("a", b"1")]))
        assert anonymous.status == 401
        assert not incoming(con, tmp_path).exists()
