"""`@require_approval` in another process: it runs only after a press, once, and never after a deny or timeout."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from kazma.approvals.client import ApprovalMismatch, canonical_hash, require_approval
from kazma.approvals.hashing import args_hash
from tests.api_support import REQUESTER_TOKEN, Door, kazma_door
from tests.child_env import child_env
from tests.mcp_support import cards

SCRIPT = """
import asyncio, sys
from kazma.approvals.client import ApprovalError, require_approval

heavy = sorted(m for m in ("telegram", "discord", "slack_sdk", "slack_bolt", "aiohttp", "mcp") if m in sys.modules)
print("heavy:", heavy, flush=True)
ran = sys.argv[1]
mode = sys.argv[2]
deadline = float(sys.argv[3]) if len(sys.argv) > 3 else None

@require_approval(reason="the test asks", deadline=deadline)
def deploy(env: str, version: int = 1) -> str:
    with open(ran, "a") as handle:
        handle.write(f"sync {env} {version}\\n")
    return "deployed"

@require_approval(deadline=deadline)
async def deploy_async(env: str) -> str:
    with open(ran, "a") as handle:
        handle.write(f"async {env}\\n")
    return "deployed"

try:
    if mode == "sync":
        print(deploy("prod", version=7), flush=True)
    else:
        print(asyncio.run(deploy_async("staging")), flush=True)
except ApprovalError as exc:
    print(type(exc).__name__, exc, flush=True)
    sys.exit(1)
"""


async def _run(door: Door, tmp: Path, mode: str, *extra: str, code: str | None = None) -> tuple[int, str, Path]:
    script = tmp / "decorated.py"
    script.write_text(SCRIPT, encoding="utf-8")
    ran = tmp / "ran.txt"
    env = child_env({"KAZMA_API_TOKEN": REQUESTER_TOKEN, "KAZMA_URL": door.url})
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), str(ran), mode, *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
    )  # fmt: skip
    if code is not None:
        await door.press(code)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), ran


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_runs_once_after_an_approve(tmp_path: Path, mode: str) -> None:
    async with kazma_door(tmp_path) as door:
        returncode, out, ran = await _run(door, tmp_path, mode, code="a")
        assert returncode == 0, out
        assert "heavy: []" in out
        assert ran.read_text().splitlines() == (["sync prod 7"] if mode == "sync" else ["async staging"])
        [request] = await door.app.service.store.requests(limit=5)
        expected = {"env": "prod", "version": 7} if mode == "sync" else {"env": "staging"}
        assert request.tool == ("deploy" if mode == "sync" else "deploy_async")
        assert request.args_hash == args_hash(expected) == canonical_hash(expected)


async def test_never_runs_after_a_deny(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door:
        returncode, out, ran = await _run(door, tmp_path, "sync", code="d")
        assert returncode == 1
        assert "ApprovalDenied" in out
        assert not ran.exists()


async def test_never_runs_after_a_timeout(tmp_path: Path) -> None:
    async with kazma_door(tmp_path) as door:
        returncode, out, ran = await _run(door, tmp_path, "async", "1")
        assert returncode == 1
        assert "ApprovalTimeout" in out
        assert not ran.exists()


async def test_attack_arguments_changed_while_waiting_do_not_run(tmp_path: Path) -> None:
    ran: list[list[str]] = []
    async with kazma_door(tmp_path) as door:

        @require_approval(url=door.url, token=REQUESTER_TOKEN)
        def delete(paths: list[str]) -> None:
            ran.append(list(paths))

        paths = ["build/"]
        call = asyncio.create_task(asyncio.to_thread(delete, paths))
        await door.telegram.wait_until(lambda: bool(cards(door.telegram)), timeout=30)
        paths.append("/")  # the caller's list changes after the card was shown
        await door.press("a")
        with pytest.raises(ApprovalMismatch):
            await asyncio.wait_for(call, 30)
        assert ran == []
