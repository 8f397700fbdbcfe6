"""``--log-level`` and ``--log-format`` before or after any subcommand.

``kazma --log-level debug run`` and ``kazma run --log-level debug`` mean the same; the last one given wins.
The settings live in the click context's ``meta``, one dict shared by a command and its subcommands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import click

if TYPE_CHECKING:
    from kazma.bot.logging import LogFormat

# The choices live here, not in kazma.bot.logging: `kazma --version` and `--help` must not import structlog.
LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("auto", "console", "json")

LOG_SETTINGS = "kazma.log"


@dataclass
class LogSettings:
    """How this process logs. ``--log-level``/``--log-format`` may come before or after the subcommand
    (``kazma --log-level debug run`` and ``kazma run --log-level debug`` are the same); the last one given wins."""

    level: str = "info"
    fmt: LogFormat = "auto"
    level_given: bool = False

    def apply(self) -> None:
        from kazma.bot.logging import configure_logging

        configure_logging(self.level, self.fmt)


def log_settings(ctx: click.Context) -> LogSettings:
    settings = ctx.meta.get(LOG_SETTINGS)  # meta is one dict shared by a command and its subcommands
    if not isinstance(settings, LogSettings):
        settings = ctx.meta[LOG_SETTINGS] = LogSettings()
    return settings


def set_log(ctx: click.Context, *, level: str | None = None, fmt: str | None = None) -> None:
    if level is None and fmt is None:
        return
    settings = log_settings(ctx)
    if level is not None:
        settings.level, settings.level_given = level, True
    if fmt is not None:
        settings.fmt = cast("LogFormat", fmt)
    if ctx.parent is not None:  # the root applies its own once parsed; a subcommand's take effect at once
        settings.apply()


def with_log_options(command: click.Command) -> None:
    """Give ``command`` and every command under it the two log options, so they may follow the subcommand."""
    if any(p.name == "log_level" for p in command.params):
        return  # a command loaded twice (its help, then its run) gets them once
    command.params += [
        click.Option(
            ["--log-level"],
            type=click.Choice(LEVELS),
            expose_value=False,
            callback=lambda ctx, _param, value: set_log(ctx, level=value),
            help="debug, info, warning or error (as before the subcommand).",
        ),
        click.Option(
            ["--log-format"],
            type=click.Choice(FORMATS),
            expose_value=False,
            callback=lambda ctx, _param, value: set_log(ctx, fmt=value),
            help="auto, console or json (as before the subcommand).",
        ),
    ]
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            with_log_options(sub)
