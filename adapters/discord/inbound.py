"""Discord messages and slash commands in the bus's neutral form (:class:`~kazma.adapters.contract.Inbound`):
payload translation only; the adapter receives, the kit's door decides what passes.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Final

import discord

from kazma.adapters.chat_text import plain_mentions
from kazma.adapters.contract import Attachment, Inbound
from kazma.adapters.discord.errors import PLATFORM
from kazma.approvals.card import BUTTON_PREFIX

# Button data Kazma acts on: approval cards (kz1:) and questions' choices (kq1:).
PRESS_PREFIXES: Final = (BUTTON_PREFIX + ":", "kq1:")

Actor = Callable[[object], str]
IsAdmin = Callable[[object], bool]


def channel_chat(channel: object, channel_id: int) -> tuple[int, int | None]:
    """(chat, thread): a thread belongs to its parent channel's conversation."""
    if isinstance(channel, discord.Thread):
        return channel.parent_id, channel.id
    return channel_id, None


def channel_title(channel: object) -> str:
    """A conversation's name as people see it: ``#general`` (a thread's parent channel), a DM's other person."""
    if isinstance(channel, discord.Thread):
        channel = channel.parent
    if isinstance(channel, discord.DMChannel):
        return channel.recipient.display_name if channel.recipient is not None else ""
    name = getattr(channel, "name", None)
    return f"#{name}" if isinstance(name, str) and name else ""


def message_inbound(
    message: discord.Message,
    *,
    actor: Actor,
    is_admin: IsAdmin,
    fetcher: Callable[[discord.Attachment], Callable[[], Awaitable[bytes]]],
) -> Inbound:
    """A message: mentioned users by name and ``@name`` words (agents have no accounts) are its mentions."""
    chat, thread = channel_chat(message.channel, message.channel.id)
    names = [u.name.lower() for u in message.mentions] + list(plain_mentions(message.content))
    author = message.author
    reference = message.reference
    return Inbound(
        platform=PLATFORM,
        chat=str(chat),
        thread=str(thread) if thread is not None else None,
        message_id=str(message.id),
        author=actor(author.id),
        author_name=author.display_name,
        text=message.content,
        mentions=tuple(dict.fromkeys(names)),
        from_bot=author.bot,
        is_admin=is_admin(author.id),
        direct=message.guild is None,
        reply_to=str(reference.message_id) if reference is not None and reference.message_id else None,
        attachments=tuple(Attachment(a.filename, a.size, fetcher(a)) for a in message.attachments),
        chat_title=channel_title(message.channel),
    )


def kept_message(inbound: Inbound, message: discord.Message, space: int | None) -> str:
    """What is kept of a message with its claim: the neutral message as the bot would have handled it, its
    files by URL (fetched, within the bounds, when handed over), and its server. The same text the
    conversation receives; dropped from the claim once taken in."""
    fields = {
        "chat": inbound.chat,
        "thread": inbound.thread,
        "message_id": inbound.message_id,
        "author": inbound.author,
        "author_name": inbound.author_name,
        "text": inbound.text,
        "mentions": list(inbound.mentions),
        "from_bot": inbound.from_bot,
        "is_admin": inbound.is_admin,
        "direct": inbound.direct,
        "reply_to": inbound.reply_to,
        "chat_title": inbound.chat_title,
        "files": [{"name": a.filename, "size": a.size, "url": a.url} for a in message.attachments],
        "space": space,
    }
    return json.dumps(fields, ensure_ascii=False, separators=(",", ":"))


def revived_message(
    payload: str, *, fetcher: Callable[[str], Callable[[], Awaitable[bytes]]]
) -> tuple[Inbound, int | None]:
    """The message and its server from what :func:`kept_message` kept (``fetcher``: a file's URL → its fetch).
    Raises ``ValueError`` (or ``KeyError``/``TypeError``) when the payload is not one."""
    fields = json.loads(payload)
    if not isinstance(fields, dict):
        raise ValueError("a kept Discord message is a JSON object")
    space = fields.get("space")
    inbound = Inbound(
        platform=PLATFORM,
        chat=str(fields["chat"]),
        thread=None if fields.get("thread") is None else str(fields["thread"]),
        message_id=str(fields["message_id"]),
        author=str(fields["author"]),
        author_name=str(fields["author_name"]),
        text=str(fields["text"]),
        mentions=tuple(str(m) for m in fields.get("mentions") or ()),
        from_bot=bool(fields.get("from_bot")),
        is_admin=bool(fields.get("is_admin")),
        direct=bool(fields.get("direct")),
        reply_to=None if fields.get("reply_to") is None else str(fields["reply_to"]),
        attachments=tuple(
            Attachment(str(f["name"]), None if f.get("size") is None else int(f["size"]), fetcher(str(f["url"])))
            for f in fields.get("files") or ()
        ),
        chat_title=str(fields.get("chat_title") or ""),
    )
    return inbound, None if space is None else int(space)


def command_inbound(
    interaction: discord.Interaction[Any],
    chat: int | None,
    thread: int | None,
    name: str,
    args: str,
    *,
    actor: Actor,
    is_admin: IsAdmin,
) -> Inbound:
    """A slash command (``/swarm``, ``/plan``) with its arguments, in the channel it was used in."""
    user = interaction.user
    return Inbound(
        platform=PLATFORM,
        chat=str(chat),
        thread=str(thread) if thread is not None else None,
        message_id=str(interaction.id),
        author=actor(user.id),
        author_name=user.display_name,
        text=args,
        command=name,
        from_bot=user.bot,
        direct=interaction.guild_id is None,
        is_admin=is_admin(user.id),
    )


def modal_value(components: Any, custom_id: str) -> str | None:
    """The text a person typed into the modal input ``custom_id`` (rows of inputs, or labels around them)."""
    if not isinstance(components, list):
        return None
    for component in components:
        if not isinstance(component, dict):
            continue
        inner = component.get("components") or ([component["component"]] if "component" in component else [])
        if inner:
            found = modal_value(inner, custom_id)
            if found is not None:
                return found
        elif component.get("custom_id") == custom_id and isinstance(component.get("value"), str):
            return str(component["value"])
    return None
