"""``kazma doctor`` on Matrix: whose the access token is, and whether the bot can work in its home room.

``whoami`` says which account the token belongs to (checked against ``user_id`` when set); the home room must
be one the bot has joined, unencrypted (Kazma cannot read an encrypted room), and its power levels must let the
bot send messages and reactions. Every problem is one line naming its fix; the token never appears in one.
Its registry entry names :func:`check`.
"""

from __future__ import annotations

from urllib.parse import quote

import httpx

from kazma.adapters.matrix.errors import ENCRYPTED_NOTICE
from kazma.adapters.platform_cli import Check, Level, json_body, token_problems
from kazma.config.models import MatrixConfig
from kazma.config.registry.matrix import SPEC

NAME = "platform.matrix"
_body = json_body


async def check(config: MatrixConfig, client: httpx.AsyncClient) -> list[Check]:
    problems = token_problems(SPEC, config)
    if problems:
        return problems
    headers = {"Authorization": f"Bearer {config.access_token}"}
    api = f"{config.homeserver}/_matrix/client/v3"
    who = await client.get(f"{api}/account/whoami", headers=headers)
    if who.status_code == 401:
        return [Check(NAME, Level.FAIL, "platforms.matrix.access_token was refused by the homeserver (401): log in "
                      "as the bot again and copy the new access token")]  # fmt: skip
    if who.status_code >= 400:
        return [Check(NAME, Level.FAIL, f"whoami failed (HTTP {who.status_code}): is {config.homeserver} the "
                      "homeserver's client API?")]  # fmt: skip
    user = str(_body(who).get("user_id", ""))
    if config.user_id and user != config.user_id:
        return [Check(NAME, Level.FAIL, f"the access token is {user}'s, not {config.user_id}'s: use the bot "
                      "account's token, or correct platforms.matrix.user_id")]  # fmt: skip
    checks = [Check(NAME, Level.OK, f"token accepted: {user}")]
    if config.home_room:
        checks.append(await _home(config, client, headers, user))
    return checks


async def _home(config: MatrixConfig, client: httpx.AsyncClient, headers: dict[str, str], user: str) -> Check:
    room = config.home_room
    api = f"{config.homeserver}/_matrix/client/v3"
    joined = await client.get(f"{api}/joined_rooms", headers=headers)
    if room not in (_body(joined).get("joined_rooms") or []):
        return Check(NAME, Level.FAIL, f"home_room {room}: the bot has not joined it: invite {user} there (it "
                     "joins a served room when invited, while Kazma runs)")  # fmt: skip
    state = f"{api}/rooms/{quote(room)}/state"
    encryption = await client.get(f"{state}/m.room.encryption", headers=headers)
    if encryption.status_code == 200 and _body(encryption).get("algorithm"):
        return Check(NAME, Level.FAIL, f"home_room {room}: {ENCRYPTED_NOTICE}")
    levels = _body(await client.get(f"{state}/m.room.power_levels", headers=headers))
    mine = int((levels.get("users") or {}).get(user, levels.get("users_default", 0)))
    events = levels.get("events") or {}
    needed = {kind: int(events.get(kind, levels.get("events_default", 0))) for kind in ("m.room.message", "m.reaction")}
    short = [f"{kind} needs {level}" for kind, level in needed.items() if mine < level]
    if short:
        return Check(NAME, Level.FAIL, f"home_room {room}: the bot's power level is {mine} and {', '.join(short)}: "
                     "raise the bot's level in the room's settings (Roles & Permissions)")  # fmt: skip
    return Check(NAME, Level.OK, f"home_room {room}: joined, unencrypted, the bot may post and react (level {mine})")
