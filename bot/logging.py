"""structlog setup: readable on a terminal, JSON lines otherwise.

Library loggers (python-telegram-bot, discord.py, slack-bolt, httpx) go
through the same formatter so one process writes one format.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

LogFormat = Literal["auto", "console", "json"]
LEVELS = ("debug", "info", "warning", "error")

# Chatty per-request loggers stay at WARNING unless debugging.
_NOISY = ("httpx", "httpcore", "aiosqlite", "discord.gateway", "discord.client", "telegram.ext.Updater")


def configure_logging(level: str = "info", fmt: LogFormat = "auto", stream: object = None) -> None:
    out = stream if stream is not None else sys.stderr
    use_json = fmt == "json" or (fmt == "auto" and not getattr(out, "isatty", lambda: False)())
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info if use_json else _identity,
            renderer,
        ],
    )
    handler = logging.StreamHandler(out)  # type: ignore[arg-type]
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    numeric = getattr(logging, level.upper())
    root.setLevel(numeric)
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.DEBUG if numeric <= logging.DEBUG else max(numeric, logging.WARNING))


def _identity(logger: object, method: str, event: structlog.types.EventDict) -> structlog.types.EventDict:
    return event
