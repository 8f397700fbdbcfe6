"""``kazma setup``: the platform settings Kazma needs, printed ready to paste.

Each platform's package holds its own commands (a Slack app manifest, a Discord invite URL); its registry
entry names them, and a command's module is imported only when it runs or its help is asked.
"""

from __future__ import annotations

import click

from kazma.bot.cli.log_options import with_log_options
from kazma.config.registry import CHAT_PLATFORMS, load_named

# "command name" -> "module:attribute", every platform's together.
_COMMANDS = {name: where for spec in CHAT_PLATFORMS.values() for name, where in spec.setup_commands.items()}


class _PlatformCommands(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in _COMMANDS:
            return None
        command = load_named(_COMMANDS[cmd_name])
        assert isinstance(command, click.Command), _COMMANDS[cmd_name]
        with_log_options(command)  # loaded here, after the group was given them
        return command


@click.group(cls=_PlatformCommands)
def setup() -> None:
    """Platform app settings, ready to paste: an app manifest, an invite URL."""
