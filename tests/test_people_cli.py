"""``kazma people invite|list|revoke`` in their own processes, on the store a running console serves: the link
printed enrols one passkey once and is kept only as a hash; revoking ends what the passkey opened."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kazma.bot.cli.cli_identity import system_login
from tests.child_env import child_env
from tests.passkey_support import CeremonyRefused, SoftAuthenticator, enrol, sign_in
from tests.test_web_server import PEOPLE, console


def people(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KAZMA_")}
    return subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", "-c", str(tmp_path / "kazma.yaml"), "people", *args],
        env=child_env(base=clean),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )


async def test_invite_enrols_once_list_shows_it_and_revoke_ends_it(tmp_path: Path) -> None:
    # the same store and people as the console the test runs (tests/test_web_server.py), and carol without web
    (tmp_path / "kazma.yaml").write_text(
        f"store: {{path: '{tmp_path / 'k.db'}'}}\napprovals: {{approvers: ['web:alice']}}\n"
        + PEOPLE
        + "  carol: {telegram: 7}\n"
    )
    async with console(tmp_path) as con:
        invited = await asyncio.to_thread(people, tmp_path, "invite", "alice")
        assert invited.returncode == 0, invited.stderr
        link = invited.stdout.strip()
        assert link.startswith("http://localhost:8765/enrol/")
        assert "One passkey for alice (web:alice), once, until" in invited.stderr
        token = link.rpartition("/")[2]

        device = SoftAuthenticator()
        async with con.client() as browser:
            await enrol(browser, con.base, link.replace("http://localhost:8765", con.base), device)
        async with con.client() as second:
            with pytest.raises(CeremonyRefused):
                await enrol(second, con.base, link.replace("http://localhost:8765", con.base), SoftAuthenticator())

        listed = await asyncio.to_thread(people, tmp_path, "list")
        assert listed.returncode == 0, listed.stderr
        lines = listed.stdout.splitlines()
        assert "alice  (approver)  web:alice" in lines
        assert "carol  (not an approver)  telegram:7" in lines
        assert any(line.startswith("    passkey ") and "passkey 1  active" in line for line in lines)

        async with con.client() as signed_in:
            await sign_in(signed_in, con.base, device)
            revoked = await asyncio.to_thread(people, tmp_path, "revoke", "alice")
            assert revoked.returncode == 0, revoked.stderr
            assert "revoked alice's passkey" in revoked.stdout
            assert (await signed_in.get(f"{con.base}/", allow_redirects=False)).status == 302  # its session ended
        async with con.client() as again:
            with pytest.raises(CeremonyRefused, match="revoked"):
                await sign_in(again, con.base, device)
        listed = await asyncio.to_thread(people, tmp_path, "list")
        assert f"by cli:{system_login()}" in listed.stdout

        nothing = await asyncio.to_thread(people, tmp_path, "revoke", "alice")
        assert nothing.returncode == 1
        assert "alice has no active passkey: nothing was revoked" in nothing.stderr
    # Read once nothing has the store open: reading its files from this process would drop this process's
    # SQLite locks on them (POSIX locks belong to the process), and another process could then remove the WAL.
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("k.db*"))
    assert b"people_invites" in raw
    assert token.encode() not in raw  # only its hash is kept


def test_invite_refuses_someone_who_cannot_enrol(tmp_path: Path) -> None:
    (tmp_path / "kazma.yaml").write_text(
        f"store: {{path: '{tmp_path / 'k.db'}'}}\npeople: {{carol: {{telegram: 7}}}}\n"
    )
    unknown = people(tmp_path, "invite", "zed")
    assert unknown.returncode == 1
    assert "'zed' is not under people: in kazma.yaml (people: carol)" in unknown.stderr
    no_web = people(tmp_path, "invite", "carol")
    assert no_web.returncode == 1
    assert "carol has no web identity: add people.carol.web" in no_web.stderr
