"""The console tells a signed-in person who cannot decide approvals why, and how to fix it, before any press."""

from __future__ import annotations

from pathlib import Path

from tests.test_web_server import OPERATOR, READER, console


async def test_a_person_who_is_not_an_approver_is_told_the_fix(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as client:
        await con.login(client, "bob", OPERATOR)  # web:alice is the configured approver, not bob's web:bob
        page = await (await client.get(f"{con.base}/")).text()
        assert "You are bob (web:bob, passkey), not an approver" in page
        assert "add &#x27;bob&#x27; to approvals.approvers in kazma.yaml" in page
    async with console(tmp_path / "again") as con, con.client() as client:
        await con.login(client, "alice", OPERATOR)
        assert "not an approver" not in await (await client.get(f"{con.base}/")).text()
        await con.login(client, "carol", READER)  # a reader never decides: nothing to fix
        assert "not an approver" not in await (await client.get(f"{con.base}/")).text()
