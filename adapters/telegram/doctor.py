"""``kazma doctor`` on Telegram: ``getMe`` accepts the token, and ``getChat`` and ``getChatMember`` say the bot is
in the home chat and may post there. Its registry entry names :func:`check`."""

from __future__ import annotations

import httpx

from kazma.adapters.platform_cli import Check, Level, json_body, token_problems
from kazma.config.models import TelegramConfig
from kazma.config.redaction import redact
from kazma.config.registry.telegram import SPEC

_IN = ("creator", "administrator", "member", "restricted")


async def check(config: TelegramConfig, client: httpx.AsyncClient) -> list[Check]:
    name = "platform.telegram"
    problems = token_problems(SPEC, config)
    if problems:
        return problems
    checks: list[Check] = []
    if config.mode == "webhook" and not config.webhook.url.startswith("https://"):
        checks.append(
            Check(
                name,
                Level.FAIL,
                "platforms.telegram.webhook.url must be https://: Telegram posts updates over TLS only",
            )
        )
    response = await client.get(f"{config.api_base_url}/bot{config.token}/getMe")
    body = json_body(response)
    if response.status_code in (401, 404):  # Telegram answers 404 for a token of no bot at all
        return [
            *checks,
            Check(
                name,
                Level.FAIL,
                f"platforms.telegram.token was refused by Telegram ({response.status_code} "
                f"{body.get('description') or response.reason_phrase}): copy it again from @BotFather "
                "(/mybots → API Token)",
            ),
        ]
    if response.status_code >= 400 or not body.get("ok"):
        detail = redact(str(body.get("description") or response.reason_phrase))
        return [*checks, Check(name, Level.FAIL, f"getMe failed (HTTP {response.status_code}: {detail})")]
    me = body.get("result") or {}
    privacy = (
        ""
        if me.get("can_read_all_group_messages")
        else "; privacy mode on: in groups it sees commands, @-mentions of it and replies to it"
    )
    checks.append(Check(name, Level.OK, f"token accepted: @{me.get('username', '?')}{privacy}"))
    home = await home_check(config, client, int(me.get("id") or 0))
    return [*checks, *([home] if home else [])]


async def home_check(config: TelegramConfig, client: httpx.AsyncClient, bot_id: int) -> Check | None:
    name = "platform.telegram"
    chat = config.home_chat
    if chat is None:
        return None  # platform_status already warns that it is not set
    base = f"{config.api_base_url}/bot{config.token}"
    found = await client.post(f"{base}/getChat", data={"chat_id": str(chat)})
    body = json_body(found)
    if not body.get("ok"):
        said = redact(str(body.get("description") or f"HTTP {found.status_code}"))
        return Check(
            name,
            Level.FAIL,
            f"home_chat {chat}: Telegram says {said!r}: add the bot to that group (or fix the id: the "
            "platform.inbound_ignored log event shows the ids of chats it is in)",
        )
    info = body.get("result") or {}
    title = str(info.get("title") or info.get("username") or chat)
    asked = await client.post(f"{base}/getChatMember", data={"chat_id": str(chat), "user_id": str(bot_id)})
    member = json_body(asked).get("result") or {}
    status = str(member.get("status") or "unknown")
    if status not in _IN:
        return Check(name, Level.FAIL, f"home_chat {chat} ({title}): the bot is not in it ({status}): add it again")
    if info.get("type") == "channel" and not (status == "creator" or member.get("can_post_messages")):
        return Check(
            name, Level.FAIL, f"home_chat {chat} ({title}) is a channel: make the bot an admin who may post messages"
        )
    if status == "restricted" and not member.get("can_send_messages"):
        return Check(name, Level.FAIL, f"home_chat {chat} ({title}): the bot may not send messages there")
    return Check(name, Level.OK, f"home_chat {chat} ({title}): the bot is in it ({status}) and may post")
