from __future__ import annotations

import logging
import os
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent

# A real PostgreSQL server per test process and an empty database per test: pg_server, pg_database, pg_dsn;
# store_engine: a store-level test on SQLite and on PostgreSQL; hang_report: a hung test prints its tasks.
pytest_plugins = ["tests.pg_support", "tests.store_backends", "tests.hang_report"]

# Every test talks to 127.0.0.1 only; a proxy from the environment must not intercept.
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
os.environ.setdefault("no_proxy", "127.0.0.1,localhost")


@pytest.fixture
def repo() -> Path:
    return REPO


# What a LogRecord has of its own (and the two names makeRecord keeps for itself): an event field named so made
# makeRecord raise KeyError inside the code that logged it (bus.card_posted's ``message`` stopped the bus worker in a
# test capturing INFO). Production logging passes the event whole and never meets it.
_RECORD_NAMES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _fields_clear_of_log_record(logger: object, method: str, event: MutableMapping[str, Any]) -> dict[str, Any]:
    """An event field a LogRecord has already is kept as ``<name>_`` (``message`` is read as ``message_``)."""
    return {f"{key}_" if key in _RECORD_NAMES and key != "event" else key: value for key, value in event.items()}


def _route_structlog_to_logging() -> None:
    """Send structlog events through stdlib logging so pytest captures them per test."""
    import structlog

    from kazma.config.log_gate import logging_configured

    logging_configured(False)  # every level reaches these processors again (a capture sees what is below WARNING)
    structlog.configure(
        processors=[
            structlog.stdlib.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _fields_clear_of_log_record,
            # fields become LogRecord attributes, so tests can read them from caplog records
            structlog.stdlib.render_to_log_kwargs,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )


_route_structlog_to_logging()


@pytest.fixture(autouse=True)
def _logging_routed_to_pytest() -> Iterator[None]:
    """A test that runs a command in this process (click's CliRunner) configures Kazma's own logging: structlog's
    processors, a root handler of its own and the root level. Put pytest's routing back after it, or every later
    test in this worker reads no events from caplog. Only Kazma's handler is taken off: others (a module's log
    watcher added during a test) stay."""
    import logging

    import structlog

    root = logging.getLogger()
    level = root.level
    yield
    _route_structlog_to_logging()
    root.setLevel(level)
    for handler in list(root.handlers):
        if isinstance(handler.formatter, structlog.stdlib.ProcessorFormatter):
            root.removeHandler(handler)
