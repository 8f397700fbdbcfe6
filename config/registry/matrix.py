"""Matrix's entry in the platform registry: its settings, ids, secret and its shape, and setup hints."""

from __future__ import annotations

import re
from typing import Final

from kazma.config.registry import InitMode, InitSetup, PlatformSpec
from kazma.config.tokens import pasted_badly

# A server name is a host name, an IPv4 address or a bracketed IPv6 address, with an optional port.
_SERVER: Final = r"(?:[A-Za-z0-9.-]{1,230}|\[[0-9A-Fa-f:.]{2,45}\])(?::[0-9]{1,5})?"
# User ids: the localpart's historical character set (the spec's grammar for ids in the wild), 255 at most.
_USER: Final = re.compile(rf"@[\x21-\x39\x3b-\x7e]{{1,200}}:{_SERVER}")
# Room ids: opaque, with the server's name (room versions 1-11) or without it (room version 12 on).
_ROOM: Final = re.compile(rf"![A-Za-z0-9._~+/=-]{{1,200}}(?::{_SERVER})?")
_TOKEN_IN_TEXT: Final = r"\bsy[tu]_[A-Za-z0-9_-]{8,}|(?<=access_token=)[^&\s\"']+"  # noqa: S105 - a pattern


def is_chat_id(chat: str) -> bool:
    return len(chat) <= 255 and bool(_ROOM.fullmatch(chat))


def is_user_id(user: str) -> bool:
    return len(user) <= 255 and bool(_USER.fullmatch(user))


def access_token_problem(token: str) -> str | None:
    """An access token of the bot's account: Element → Settings → Help & About → Access Token, or a login."""
    if token.lower().startswith("bearer "):
        return "starts with 'Bearer ': that belongs to the HTTP header, not the token; remove it"
    badly = pasted_badly(token)
    if badly:
        return badly
    if token.startswith(("@", "!", "#")):
        return "is a Matrix id, not an access token: copy the bot account's access token (Element → Help & About)"
    if token.startswith(("http://", "https://")):
        return "is a URL: that belongs in platforms.matrix.homeserver; access_token takes the bot's access token"
    return None


SPEC: Final = PlatformSpec(
    order=4,
    name="matrix",
    title="Matrix",
    token_key="access_token",  # noqa: S106 - the name of a setting, not a secret
    home_key="home_room",
    chats_key="rooms",
    is_chat_id=is_chat_id,
    chat_id_hint="a Matrix room id starts with '!', e.g. !AbCdEf123:example.org (room settings → Advanced)",
    is_user_id=is_user_id,
    user_id_hint="a Matrix user id is @name:server, e.g. @alice:example.org",
    example_user="@alice:example.org",
    adapter="kazma.adapters.matrix:MatrixAdapter",
    secrets=("access_token",),
    env={"access_token": "MATRIX_ACCESS_TOKEN"},
    placeholders={"MATRIX_ACCESS_TOKEN": "syt_placeholder", "MATRIX_HOMESERVER": "https://matrix.example.org"},
    token_judges={"access_token": access_token_problem},
    # mautrix sends the token in a header; a URL a homeserver or a proxy logs may still carry it as a parameter.
    log_token_pattern=_TOKEN_IN_TEXT,
    noisy_loggers=("mau.http",),
    init=InitSetup(
        user_flag_help="Your Matrix user id (@you:example.org).",
        chat_flag_help="The Matrix room Kazma serves (its id, !…).",
        user_hint="a Matrix user id looks like @alice:example.org (your avatar → your name shows it)",
        chat_hint="invite the bot's account to the room; room settings → Advanced shows its id (!…)",
        # One way in (the client API's /sync); what it needs besides the token is the homeserver's address.
        modes=(
            InitMode(
                "sync",
                ("MATRIX_HOMESERVER",),
                "    homeserver: ${MATRIX_HOMESERVER}  # the client API's URL, e.g. https://matrix.example.org",
            ),
        ),
    ),
    transport=lambda section: "sync",
    doctor="kazma.adapters.matrix.doctor:check",
)
