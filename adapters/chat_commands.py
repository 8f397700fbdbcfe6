"""The chat commands every platform offers, in one list: each platform's menu, slash commands and parser read it.

Telegram registers them as the bot's command menu, Discord as application commands, Slack in its app manifest
and as Bolt command listeners, Matrix (no command menu) by parsing the message text. A command added here is
offered everywhere; the engine answers it by name (``Inbound.command``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True)
class ChatCommand:
    name: str  # without the slash: "swarm"
    summary: str  # one line for a platform's command menu
    usage: str = ""  # what may follow it ("" when it takes nothing)
    usage_example: str = ""  # an example of what may follow it, for a menu's argument description


CHAT_COMMANDS: Final = (
    ChatCommand(
        "swarm",
        "Drive the agent swarm",
        "help | status | pipeline quick <task>",
        "The command and its arguments, e.g. 'status' or 'pipeline quick <task>'",
    ),
    ChatCommand("plan", "Show this chat's current plan"),
    ChatCommand("approvals", "List the approval requests waiting for you"),
)
COMMAND_NAMES: Final = frozenset(command.name for command in CHAT_COMMANDS)

# A message that is one of the commands as text (for platforms without native commands): its name, its rest.
COMMAND_TEXT: Final = re.compile(
    rf"^/({'|'.join(re.escape(c.name) for c in CHAT_COMMANDS)})(?:\s+(.*))?$", re.DOTALL | re.IGNORECASE
)
