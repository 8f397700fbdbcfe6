"""A Telegram message in the bus's neutral form (:class:`~kazma.adapters.contract.Inbound`): payload
translation only; the adapter receives, the kit's door decides what passes.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import structlog
from telegram import Message
from telegram.constants import ChatType, MessageEntityType

from kazma.adapters.chat_commands import COMMAND_NAMES
from kazma.adapters.chat_text import plain_mentions
from kazma.adapters.contract import Attachment, Inbound
from kazma.adapters.telegram.errors import PLATFORM

Fetcher = Callable[[str], Callable[[], Coroutine[Any, Any, bytes]]]

log = structlog.get_logger("kazma.adapters.telegram")


def normalise(
    message: Message,
    *,
    bot_username: str,
    actor: Callable[[object], str],
    is_admin: Callable[[object], bool],
    fetcher: Fetcher,
) -> Inbound | None:
    """The neutral form of ``message``, or None when it is a command for another bot (``bot_username``:
    ours, lowercase). ``fetcher`` makes the download of one file id, run only when the file is saved."""
    chat = message.chat
    text = message.text if message.text is not None else (message.caption or "")
    entities = message.parse_entities() if message.text is not None else message.parse_caption_entities()
    command: str | None = None
    body = text
    for entity, value in entities.items():
        if entity.type != MessageEntityType.BOT_COMMAND or entity.offset != 0:
            continue
        word, _, target = value.removeprefix("/").partition("@")
        if word.lower() not in COMMAND_NAMES:
            continue
        if target and target.lower() != bot_username:
            log.debug("telegram.command_for_other_bot", chat=chat.id, target=target)
            return None
        command = word.lower()
        body = text[len(value) :].strip()
    user = message.from_user
    if user is not None and message.sender_chat is None:
        author, author_name = actor(user.id), user.full_name or (user.username or str(user.id))
        from_bot, admin = user.is_bot, is_admin(user.id)
    else:
        # Posted on behalf of a chat (an anonymous admin of this group, a linked channel): nobody we can authorise.
        # Telegram then puts a fake user in "from" (GroupAnonymousBot, a bot: the message was dropped as a bot's
        # post; or "Telegram", 777000, who would have been taken for a person).
        sender = message.sender_chat
        author = actor(sender.id if sender else "unknown")
        author_name = (sender.title or "") if sender else ""
        from_bot, admin = False, False
    thread = str(message.message_thread_id) if message.is_topic_message and message.message_thread_id else None
    return Inbound(
        platform=PLATFORM,
        chat=str(chat.id),
        message_id=str(message.message_id),
        author=author,
        author_name=author_name,
        text=body,
        thread=thread,
        mentions=plain_mentions(body if command is None else text),
        from_bot=from_bot,
        command=command,
        is_admin=admin,
        direct=chat.type == ChatType.PRIVATE,
        reply_to=str(message.reply_to_message.message_id) if message.reply_to_message else None,
        attachments=attachments(message, fetcher),
        chat_title=chat.effective_name or "",  # a group's title; a private chat's person
    )


def attachments(message: Message, fetcher: Fetcher) -> tuple[Attachment, ...]:
    """A document, or the largest size of a photo: fetched (getFile, then the file URL) only when saved."""
    found: list[tuple[str, str, int | None]] = []
    if message.document is not None:
        doc = message.document
        found.append((doc.file_id, doc.file_name or f"document-{doc.file_unique_id}", doc.file_size))
    if message.photo:
        photo = max(message.photo, key=lambda size: size.width * size.height)
        found.append((photo.file_id, f"photo-{photo.file_unique_id}.jpg", photo.file_size))
    return tuple(Attachment(name, size, fetcher(file_id)) for file_id, name, size in found)
