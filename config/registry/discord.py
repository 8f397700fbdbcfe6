"""Discord's entry in the platform registry: its settings, ids, secrets and their shape, and setup hints."""

from __future__ import annotations

import re
from typing import Final

from kazma.config.registry import InitSetup, PlatformSpec
from kazma.config.tokens import pasted_badly

_UINT64_MAX: Final = 2**64 - 1
_ID: Final = re.compile(r"[1-9][0-9]{0,19}")


def is_id(value: str) -> bool:
    """A snowflake: channels, users and servers alike."""
    return bool(_ID.fullmatch(value)) and int(value) <= _UINT64_MAX


def token_problem(token: str) -> str | None:
    """A bot token is three dot-separated parts; Kazma adds the ``Bot `` authorisation prefix itself."""
    for prefix in ("Bot ", "Bearer ", "bot "):
        if token.startswith(prefix):
            return f"starts with '{prefix.strip()} ': Kazma adds that prefix itself; put only the token in the setting"
    badly = pasted_badly(token)
    if badly:
        return badly
    if re.fullmatch(r"[A-Za-z0-9_-]{32}", token):
        return "looks like the OAuth2 client secret (32 characters, no dots): the bot token is under Bot → Reset Token"
    return None


SPEC: Final = PlatformSpec(
    order=3,
    name="discord",
    title="Discord",
    token_key="token",  # noqa: S106 - the name of a setting, not a secret
    home_key="home_channel",
    chats_key="channels",
    is_chat_id=is_id,
    chat_id_hint="a Discord channel id is a positive number, e.g. 123456789012345678",
    is_user_id=is_id,
    user_id_hint="a Discord user id is a positive number, e.g. 123456789012345678",
    example_user="123456789012345678",
    adapter="kazma.adapters.discord:DiscordAdapter",
    spaces_key="guilds",
    secrets=("token", "sign_in.client_secret"),  # no recognisable shape: redacted by value only
    env={"token": "DISCORD_BOT_TOKEN"},
    placeholders={"DISCORD_BOT_TOKEN": "placeholder"},
    token_judges={"token": token_problem},
    noisy_loggers=("discord.gateway", "discord.client"),
    init=InitSetup(
        user_flag_help="Your Discord user id.",
        chat_flag_help="The Discord channel Kazma serves.",
        user_hint="a Discord user id is a number (Developer Mode on → right-click your name)",
        chat_hint="with Developer Mode on, right-click the channel → Copy Channel ID",
    ),
    doctor="kazma.adapters.discord.doctor:check",
    setup_commands={"discord-invite": "kazma.adapters.discord.setup:discord_invite_command"},
    # discord.py's voice (PyNaCl, when installed: a dev install has it with Synapse): Kazma never joins a voice
    # channel; importing it cost 15-20 ms of CPU, 50-80 ms of libsodium's start and about 1 MB at every start
    unused_imports=lambda section: ("nacl",),
)
