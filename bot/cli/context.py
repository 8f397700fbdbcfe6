"""What every ``kazma`` subcommand receives: where the configuration is, and how to load it."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kazma.bot.logging import redact_config_secrets
from kazma.config import ConfigError, LoadedConfig, load_config

EXIT_CONFIG = 2


class Context:
    def __init__(self, config_path: Path | None) -> None:
        self.config_path = config_path

    def load(self, path: Path | None = None, *, platform_secrets: bool = False) -> LoadedConfig:
        """Load the configuration or exit 2 with one line per problem.

        Most commands never talk to a platform (the approvals, the store, keys, people, the swarm's records):
        for them a platform whose secret is not in the environment is simply off. ``platform_secrets=True``
        (``kazma run``, ``kazma config check``) makes every unset secret an error again."""
        try:
            return self.load_or_raise(path, platform_secrets=platform_secrets)
        except ConfigError as exc:
            for line in exc.lines:
                click.echo(line, err=True)
            sys.exit(EXIT_CONFIG)

    def load_or_raise(self, path: Path | None = None, *, platform_secrets: bool = False) -> LoadedConfig:
        """As :meth:`load`, but a configuration that cannot be used raises its :class:`ConfigError` for the
        command to report in its own shape (``kazma doctor``: a failed check)."""
        loaded = load_config(path or self.config_path, platform_secrets=platform_secrets)
        redact_config_secrets(loaded.config)  # whatever a library logs later, these never reach the log
        return loaded
