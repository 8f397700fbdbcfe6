"""Deny with a reason on Telegram, which has no modal: the press posts a prompt replying to the card, and the
presser's reply to that prompt, within :data:`~kazma.adapters.deny_reason.REPLY_WINDOW_SECONDS`, is the reason.
A reply by anybody else, or after the window, is no reason (the replier is told; it is not handed to the agents
either).

The prompt is its own record: Telegram hands the replied-to message with every reply, as its server has it (the
sender, the text, the entities, the date). A prompt is the bot's own message whose text is the prompt's wording
after a mention of the presser that carries their user id (a ``text_mention``). So any process reads a reply the
same way: the one that posted the prompt, the same one after a restart, another replica serving the webhook.
Nothing is kept in memory that a restart could lose and let the words through to the agents as chat.
"""

from __future__ import annotations

from dataclasses import dataclass

from telegram import Message, MessageEntity, User

from kazma.adapters.deny_reason import (
    PROMPT_EXPIRED,
    PROMPT_NOT_YOURS,
    REPLY_WINDOW_SECONDS,
    deny_data,
    prompt_request,
)


@dataclass(frozen=True)
class Prompt:
    user: int | None  # only this person's reply counts; None: the mention is gone (see ``username``)
    username: str | None  # the presser's @username the prompt names, lowercase, when its mention is gone
    data: str  # the plain Deny's data (kz1:<id>:d)
    asked_at: float  # the prompt's date, as Telegram's server has it (seconds since the epoch)

    def refusal(self, user: int, username: str | None, now: float) -> str | None:
        """Why the reply of ``user`` (``username``) at ``now`` gives this prompt no reason; None when it does.
        A prompt that says neither whose id nor whose username it is takes no reason from anybody."""
        if now > self.asked_at + REPLY_WINDOW_SECONDS:
            return PROMPT_EXPIRED
        if self.user is not None:
            return None if self.user == user else PROMPT_NOT_YOURS
        if self.username is not None:
            return None if self.username == (username or "").lower() else PROMPT_NOT_YOURS
        return PROMPT_EXPIRED


def who_entity(who: str, user_id: int, length: int) -> MessageEntity:
    """The mention of the presser that opens a prompt: it notifies them, and it says whose the prompt is."""
    return MessageEntity(
        MessageEntity.TEXT_MENTION, 0, length, user=User(id=user_id, first_name=who or str(user_id), is_bot=False)
    )


def prompt_of(message: Message, bot_id: int) -> Prompt | None:
    """The reason prompt ``message`` is (the replied-to message of a reply), or None when it is none: only the
    bot's own message with the prompt's wording is, so a person's look-alike text never is."""
    sender = message.from_user
    if sender is None or sender.id != bot_id or not message.text:
        return None
    first = next(iter(message.entities), None)
    if first is not None and first.type == MessageEntity.TEXT_MENTION and first.offset == 0:
        named = message.parse_entity(first)
        request_id = prompt_request(message.text[len(named) :])
        user = first.user.id if first.user is not None else None
        username = None
    else:
        # Telegram dropped the mention (it does for a user whose privacy settings hide them from the bot): still a
        # prompt, whose the @username it names says (a person without one: nobody's, so no reason from anybody).
        who, request_id = _unnamed(message.text)
        user, username = None, (who[1:].lower() if who.startswith("@") and len(who) > 1 else None)
    if request_id is None:
        return None
    return Prompt(user, username, deny_data(request_id), message.date.timestamp())


def _unnamed(text: str) -> tuple[str, str | None]:
    """The name and the request of a prompt whose mention is gone: the name is whatever comes before the wording."""
    cut = 0
    while (cut := text.find(": reply to this message", cut)) >= 0:
        request_id = prompt_request(text[cut:])
        if request_id is not None:
            return text[:cut], request_id
        cut += 1
    return "", None
