"""Whether a logger's events at a level are written at all, asked before a log call builds anything.

A structlog call through a module's lazy logger binds a new logger on every call, even one its level then drops
(a filtered ``log.info`` on a press cost ~5 µs of binding). A hot path asks :meth:`LevelGate.on` first. Until
logging is configured (``kazma.bot.logging.configure_logging`` says so here) every call goes through, as
structlog's defaults print every level (tests that capture events without configuring keep seeing them); once
configured, the gate is the stdlib logger's own level test, which is what the configured chain filters on.
"""

from __future__ import annotations

import logging

_configured = [False]


def logging_configured(configured: bool = True) -> None:
    """The structlog chain now filters on the stdlib loggers' levels (``configure_logging`` ran)."""
    _configured[0] = configured


class LevelGate:
    """One logger's test for one level: cheap (the stdlib caches ``isEnabledFor``) and always in sync with it."""

    __slots__ = ("_level", "_std")

    def __init__(self, name: str, level: int) -> None:
        self._std = logging.getLogger(name)
        self._level = level

    @property
    def on(self) -> bool:
        return not _configured[0] or self._std.isEnabledFor(self._level)
