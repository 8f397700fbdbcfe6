"""Slack events in the bus's terms: which posts are conversation, the keys that fold Slack's retries and
replays into one event, mentions, and a message's files. Payload translation only; the adapter receives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Final

from slack_bolt.request.async_request import AsyncBoltRequest

from kazma.adapters.chat_text import plain_mentions
from kazma.adapters.contract import Attachment
from kazma.adapters.slack.render import strip_user_mentions, unescape, user_mentions

# Only ordinary posts are conversation; edits, joins, deletions and the like are not.
MESSAGE_SUBTYPES: Final = frozenset({None, "bot_message", "thread_broadcast", "file_share", "me_message"})
_SEEN_LIMIT: Final = 4096
REPLAY_WINDOW: Final = 300.0  # Slack refuses signatures older than five minutes; Bolt checks that


def replay_keys(request: AsyncBoltRequest, body: dict[str, Any]) -> list[str]:
    keys: list[str] = []
    signature = request.headers.get("x-slack-signature")
    if signature:
        keys.append(f"sig:{signature[0]}")
    if body.get("event_id"):
        keys.append(f"event:{body['event_id']}")
    if body.get("trigger_id"):
        keys.append(f"trigger:{body['trigger_id']}")
    return keys


def interaction_key(body: dict[str, Any], action: dict[str, Any]) -> str | None:
    """One press: its trigger id, else who pressed what when (``action_ts`` is unique per press)."""
    if body.get("trigger_id"):
        return f"action:{body['trigger_id']}"
    action_ts = action.get("action_ts")
    user = (body.get("user") or {}).get("id")
    return f"action:{user}:{action.get('action_id')}:{action_ts}" if action_ts else None


class Seen:
    """A bounded memory of (channel, ts) keys: app_mention and message both fire for one post."""

    def __init__(self, limit: int = _SEEN_LIMIT) -> None:
        self._keys: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._limit = limit

    def first_time(self, key: tuple[str, str]) -> bool:
        if key in self._keys:
            self._keys.move_to_end(key)
            return False
        self._keys[key] = None
        while len(self._keys) > self._limit:
            self._keys.popitem(last=False)
        return True


def mentions_in(text: str) -> tuple[str, ...]:
    """``<@U…>`` user ids and plain ``@name`` words (how agents address each other), lowercased, once each."""
    return tuple(dict.fromkeys([*user_mentions(text), *plain_mentions(unescape(strip_user_mentions(text)))]))


def attachments(
    event: dict[str, Any], fetcher: Callable[[str], Callable[[], Awaitable[bytes]]]
) -> tuple[Attachment, ...]:
    """The files of a ``file_share`` message; each is fetched from its private URL with the bot token."""
    found = []
    for item in event.get("files") or []:
        if not isinstance(item, dict):
            continue
        url = str(item.get("url_private_download") or item.get("url_private") or "")
        if not url:  # a file the bot may not read (another workspace's, or tombstoned)
            continue
        size = item.get("size")
        found.append(
            Attachment(
                str(item.get("name") or item.get("title") or item.get("id") or "file"),
                int(size) if isinstance(size, int) else None,
                fetcher(url),
            )
        )
    return tuple(found)
