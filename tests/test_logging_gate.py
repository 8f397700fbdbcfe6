"""The level gate a hot path asks before a log call: in step with the configured levels, open until then."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from kazma.approvals import Decision, PressVerdict, button_data
from kazma.approvals.model import utc_text
from kazma.bot.logging import configure_logging
from kazma.config.log_gate import LevelGate, logging_configured
from tests.approvals_support import approval_service


def _state() -> str:
    """What besides configure_logging decides a kazma logger's levels: said when an assertion fails (CI once saw
    the gate shut at INFO after configure_logging("info") in a worker that had run other tests first: Bolt, its
    app then named "kazma", had pinned the "kazma" logger at the root's WARNING; see BOLT_APP_NAME)."""
    kazma = logging.getLogger("kazma")
    approvals = logging.getLogger("kazma.approvals")
    return (
        f"disable={logging.root.manager.disable} root={logging.root.level} kazma={kazma.level}/{kazma.disabled} "
        f"approvals={approvals.level}/{approvals.disabled}/{approvals.getEffectiveLevel()}"
    )


@pytest.fixture(autouse=True)
def _kazma_loggers_as_configured() -> Iterator[None]:
    """Each case starts from loggers only configure_logging set: no level another test left on a kazma logger,
    no ``logging.disable``."""
    manager = logging.root.manager
    disabled_below = manager.disable
    touched = [
        (logger, logger.level, logger.disabled)
        for name, logger in list(manager.loggerDict.items())
        if isinstance(logger, logging.Logger) and (name == "kazma" or name.startswith("kazma."))
    ]
    logging.disable(logging.NOTSET)
    for logger, _, _ in touched:
        logger.disabled = False
        logger.setLevel(logging.NOTSET)
    yield
    for logger, level, disabled in touched:
        logger.setLevel(level)
        logger.disabled = disabled
    logging.disable(disabled_below)


def test_the_gate_follows_the_configured_levels_and_is_open_before_configuration() -> None:
    gate = LevelGate("kazma.test_gate", logging.INFO)
    seen = [gate.on]  # not configured (the test routing): a capture sees every level
    configure_logging("warning", "json", io.StringIO())
    seen.append(gate.on)
    logging.getLogger("kazma.test_gate").setLevel(logging.DEBUG)  # a logger's own level counts, as in the chain
    try:
        seen.append(gate.on)
    finally:
        logging.getLogger("kazma.test_gate").setLevel(logging.NOTSET)
    configure_logging("info", "json", io.StringIO())
    seen.append(gate.on)
    logging_configured(False)
    seen.append(gate.on)
    assert seen == [True, False, True, True, True], _state()


async def test_a_press_at_warning_builds_no_info_line_and_at_info_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The winner's ``approvals.decided`` line: at WARNING nothing of it is built (no logger bound, no call);
    at INFO it is written as before."""
    bound: list[str] = []
    original = structlog._config.BoundLoggerLazyProxy.bind

    def counting(self: Any, **new_values: Any) -> Any:
        bound.append(str(self._logger_factory_args))
        return original(self, **new_values)

    monkeypatch.setattr(structlog._config.BoundLoggerLazyProxy, "bind", counting)
    out = io.StringIO()
    async with approval_service(tmp_path / "a.db") as service:
        request = await service.open("shell", {"cmd": "ls"}, "agent:builder", "telegram:-100")
        other = await service.open("shell", {"cmd": "pwd"}, "agent:builder", "telegram:-100")
        configure_logging("warning", "json", out)
        bound.clear()
        won = await service.decide_from_button(
            button_data(request.id, Decision.APPROVE), actor="slack:U111", platform="slack"
        )
        assert won.verdict is PressVerdict.WON
        assert [b for b in bound if "kazma.approvals" in b] == []
        configure_logging("info", "json", out)
        won = await service.decide_from_button(
            button_data(other.id, Decision.DENY), actor="slack:U111", platform="slack"
        )
        assert won.verdict is PressVerdict.WON
    assert '"event": "approvals.decided"' in out.getvalue(), _state()
    assert other.id in out.getvalue()
    assert request.id not in out.getvalue()


async def test_the_test_routing_captures_the_decided_line_after_a_configuration(tmp_path: Path) -> None:
    """A test that configured Kazma's logging leaves the gate open again for the next (the conftest's routing)."""
    from tests.conftest import _route_structlog_to_logging

    configure_logging("warning", "json", io.StringIO())
    _route_structlog_to_logging()
    logging.getLogger().setLevel(logging.WARNING)
    async with approval_service(tmp_path / "a.db") as service:
        request = await service.open("shell", {"cmd": "ls"}, "agent:builder", "telegram:-100")
        with capture_logs() as logs:
            await service.decide_from_button(button_data(request.id, Decision.APPROVE), actor="slack:U111",
                                             platform="slack")  # fmt: skip
    assert [e["request_id"] for e in logs if e["event"] == "approvals.decided"] == [request.id]


@pytest.mark.parametrize(
    "at",
    [
        datetime(2026, 12, 2, 1, 2, 3, 456789, tzinfo=UTC),
        datetime(1999, 1, 1, 23, 59, 59, tzinfo=timezone(timedelta(hours=-5))),  # another zone: shown in UTC
        datetime(2026, 3, 29, 0, 30, tzinfo=timezone(timedelta(hours=3, minutes=30))),
    ],
)
def test_an_outcome_date_reads_as_strftime_wrote_it(at: datetime) -> None:
    assert utc_text(at) == at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
