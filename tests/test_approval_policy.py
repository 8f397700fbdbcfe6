from __future__ import annotations

import asyncio
from pathlib import Path

from kazma.approvals import Decision, SafetyPolicy, Status
from tests.approvals_support import ManualClock, RecordingPublisher, approval_service


async def test_read_and_write_tools_run_without_a_card(tmp_path: Path) -> None:
    publisher = RecordingPublisher()
    async with approval_service(tmp_path / "k.db", publisher=publisher) as service:
        policy = SafetyPolicy(service)
        verdict = await policy.check("read_file", {"path": "a"}, requested_by="agent:r", conversation="web:c")
        assert verdict.allowed
        assert publisher.published == []


async def test_unclassified_tool_needs_approval_and_approve_lets_it_run(tmp_path: Path) -> None:
    publisher = RecordingPublisher()
    async with approval_service(tmp_path / "k.db", publisher=publisher) as service:
        policy = SafetyPolicy(service)
        check = asyncio.create_task(
            policy.check("deploy_prod", {"env": "prod"}, requested_by="agent:b", conversation="web:c")
        )
        while not publisher.published:
            await asyncio.sleep(0)
        card = publisher.published[0]
        assert card.tool == "deploy_prod"
        await service.decide_from_button(card.button_data(Decision.APPROVE), actor="web:admin", platform="web")
        verdict = await asyncio.wait_for(check, timeout=10)
        assert verdict.allowed
        assert verdict.request_id == card.request_id


async def test_denied_call_does_not_run(tmp_path: Path) -> None:
    publisher = RecordingPublisher()
    async with approval_service(tmp_path / "k.db", publisher=publisher) as service:
        policy = SafetyPolicy(service)
        check = asyncio.create_task(policy.check("shell", {"command": "ls"}, requested_by="agent:b", conversation="c"))
        while not publisher.published:
            await asyncio.sleep(0)
        await service.decide_from_button(
            publisher.published[0].button_data(Decision.DENY), actor="telegram:111", platform="telegram"
        )
        verdict = await asyncio.wait_for(check, timeout=10)
        assert not verdict.allowed
        assert verdict.reason == "Denied by telegram:111. Do not retry this call."


async def test_timeout_does_not_run_and_is_not_called_a_denial(tmp_path: Path) -> None:
    clock = ManualClock()
    publisher = RecordingPublisher()
    async with approval_service(tmp_path / "k.db", publisher=publisher, clock=clock, poll_interval=0.01) as service:
        policy = SafetyPolicy(service)
        check = asyncio.create_task(policy.check("shell", {"command": "ls"}, requested_by="agent:b", conversation="c"))
        while not publisher.published:
            await asyncio.sleep(0)
        clock.advance(601)
        verdict = await asyncio.wait_for(check, timeout=10)
        assert not verdict.allowed
        assert verdict.outcome is not None
        assert verdict.outcome.status is Status.TIMEOUT
        assert "not denied" in verdict.reason
        assert "Denied" not in verdict.reason


async def test_no_platform_fails_closed(tmp_path: Path) -> None:
    for publisher in (None, RecordingPublisher(available=False)):
        async with approval_service(tmp_path / "k.db", publisher=publisher) as service:
            verdict = await SafetyPolicy(service).check(
                "shell", {"command": "ls"}, requested_by="agent:b", conversation="c"
            )
            assert not verdict.allowed
            assert "no platform can show an approval card" in verdict.reason
            assert await service.store.requests() == []


async def test_unrenderable_call_is_refused_without_a_card(tmp_path: Path) -> None:
    publisher = RecordingPublisher()
    async with approval_service(tmp_path / "k.db", publisher=publisher) as service:
        verdict = await SafetyPolicy(service).check(
            "shell", {"timeout_s": float("nan")}, requested_by="agent:b", conversation="c"
        )
        assert not verdict.allowed
        assert "cannot be shown faithfully" in verdict.reason
        assert publisher.published == []
