"""Matrix events in the bus's terms: which timeline events are conversation, commands, mentions, replies and
files. Payload translation only (events are the client-server API's JSON); the adapter receives.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from kazma.adapters.chat_commands import COMMAND_TEXT
from kazma.adapters.chat_text import plain_mentions
from kazma.adapters.contract import Attachment, Inbound
from kazma.adapters.matrix.errors import PLATFORM

TEXT_TYPES: Final = frozenset({"m.text", "m.notice", "m.emote"})
FILE_TYPES: Final = frozenset({"m.file", "m.image", "m.audio", "m.video"})
ENCRYPTED: Final = "m.room.encrypted"

Fetcher = Callable[[str], Callable[[], Awaitable[bytes]]]
# An mxc:// address as the spec writes it: a server name (a host name, an IPv4 or a bracketed IPv6 address, a port)
# and a media id of letters, digits, "_" and "-". Anything else is a sender's own text, and put into the download
# path it could climb out of the media API ("../"): any client API read, with the bot's access token.
_SERVER_NAME: Final = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")
_MEDIA_ID: Final = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True)
class Reaction:
    """An ``m.annotation`` on an event: who reacted with which key to which event."""

    event_id: str  # the reaction's own id (the press's key across replicas)
    sender: str
    target: str  # the reacted-to event
    key: str


def relation(content: dict[str, Any]) -> dict[str, Any]:
    relates = content.get("m.relates_to")
    return relates if isinstance(relates, dict) else {}


def reply_target(content: dict[str, Any]) -> str | None:
    """The event a message replies to, when it is a reply."""
    reply = relation(content).get("m.in_reply_to")
    target = reply.get("event_id") if isinstance(reply, dict) else None
    return str(target) if isinstance(target, str) else None


def without_reply_fallback(body: str) -> str:
    """A reply's own words: older clients quote the replied-to message first (``> <@a:b> …`` lines, a blank)."""
    lines = body.split("\n")
    if not lines or not lines[0].startswith("> <"):
        return body
    index = 0
    while index < len(lines) and lines[index].startswith(">"):
        index += 1
    if index < len(lines) and lines[index] == "":
        index += 1
    return "\n".join(lines[index:])


def reply_words(content: dict[str, Any]) -> str:
    """The words of a reply, as a reason: a text's own (no quoted fallback), a file's caption (Matrix 1.10: a
    ``body`` other than its ``filename``); empty for a file alone, whose ``body`` is only its name."""
    body = content.get("body")
    msgtype = content.get("msgtype")
    if not isinstance(body, str):
        return ""
    if msgtype in TEXT_TYPES:
        return without_reply_fallback(body).strip()
    filename = content.get("filename")
    if msgtype in FILE_TYPES and isinstance(filename, str) and filename and filename != body:
        return without_reply_fallback(body).strip()
    return ""


def reaction_of(event: dict[str, Any]) -> Reaction | None:
    if event.get("type") != "m.reaction":
        return None
    relates = relation(event.get("content") or {})
    target, key = relates.get("event_id"), relates.get("key")
    if relates.get("rel_type") != "m.annotation" or not isinstance(target, str) or not isinstance(key, str):
        return None
    return Reaction(str(event.get("event_id", "")), str(event.get("sender", "")), target, key)


def is_edit(content: dict[str, Any]) -> bool:
    return relation(content).get("rel_type") == "m.replace"


def media_of(url: str) -> tuple[str, str] | None:
    """The server name and media id of an ``mxc://`` address, or None when it is not one the spec allows."""
    if not url.startswith("mxc://"):
        return None
    server, _, media = url.removeprefix("mxc://").partition("/")
    if _SERVER_NAME.fullmatch(server) is None or _MEDIA_ID.fullmatch(media) is None:
        return None
    return server, media


def attachment_of(content: dict[str, Any], fetcher: Fetcher) -> Attachment | None:
    """A file message's file: its name (``filename``, else the body), declared size and media URL."""
    url = content.get("url")
    if not isinstance(url, str) or media_of(url) is None:
        return None  # an encrypted file (``file``) or a broken or forged address: nothing Kazma can fetch
    info = content.get("info") if isinstance(content.get("info"), dict) else {}
    size = info.get("size") if isinstance(info, dict) else None
    name = content.get("filename") or content.get("body") or "file"
    return Attachment(str(name), size if isinstance(size, int) and not isinstance(size, bool) else None, fetcher(url))


def normalise(
    event: dict[str, Any],
    room: str,
    *,
    direct: bool,
    actor: Callable[[str], str],
    is_admin: Callable[[str], bool],
    fetcher: Fetcher,
    pending_files: list[Attachment] | None = None,
) -> Inbound | None:
    """The neutral form of an ``m.room.message`` (a text, a command, a file), or None for anything else.

    A file arrives as an event of its own; its caption is ``body`` when ``filename`` names the file (Matrix
    1.10 media captions), else it has none.
    """
    if event.get("type") != "m.room.message":
        return None
    content = event.get("content")
    if not isinstance(content, dict) or is_edit(content):
        return None  # an edit is not a new message: the original was handled
    msgtype = content.get("msgtype")
    body = content.get("body")
    if not isinstance(body, str):
        return None
    sender = str(event.get("sender", ""))
    files: tuple[Attachment, ...] = ()
    if msgtype in FILE_TYPES:
        found = attachment_of(content, fetcher)
        if found is None:
            return None
        files = (found,)
        body = body if content.get("filename") and content.get("filename") != body else ""
    elif msgtype not in TEXT_TYPES:
        return None
    replying = reply_target(content)
    text = without_reply_fallback(body) if replying else body
    command = None
    match = COMMAND_TEXT.match(text.strip())
    if match and msgtype != "m.notice":
        command = match.group(1).lower()
        text = (match.group(2) or "").strip()
    return Inbound(
        platform=PLATFORM,
        chat=room,
        message_id=str(event.get("event_id", "")),
        author=actor(sender),
        author_name=sender,
        text=text,
        mentions=() if command else plain_mentions(text),
        from_bot=msgtype == "m.notice",  # what bots post, by Matrix's convention (no bot answers one: no loops)
        command=command,
        is_admin=is_admin(sender),
        direct=direct,
        reply_to=replying,
        attachments=files,
    )
