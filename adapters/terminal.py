"""A platform that is a terminal: messages and cards are printed, presses are typed (or made for you).

Used by ``kazma demo`` so the whole loop can be seen with no chat platform at
all. Presses are recorded as ``cli:<login>``, so the login must be an approver.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import sys
import textwrap
import threading
from typing import IO

from kazma.adapters.card_layout import PlainWriter, lay_out
from kazma.adapters.contract import CardRef, Handlers, PlatformError, Press, refuse_elsewhere
from kazma.approvals.card import ApprovalCard
from kazma.approvals.honesty import reveal, reveal_line
from kazma.approvals.model import Decision, Outcome
from kazma.config.address import Actor, Address
from kazma.config.outgoing import Outgoing
from kazma.config.supervisor import Supervisor


class TerminalAdapter:
    name = "cli"

    def __init__(
        self,
        *,
        login: str = "demo",
        out: IO[str] | None = None,
        interactive: bool | None = None,
        auto: Decision | None = Decision.APPROVE,
        chat: str = "terminal",
        link_note: str | None = None,
        end_of_input: Decision | None = None,
    ) -> None:
        self.login = login
        self.link_note = link_note  # shown instead of the card's link when no console serves it
        self.out = out or sys.stdout
        self.interactive = stdin_is_terminal() if interactive is None else interactive
        # Pressed when the input ends at the prompt (Ctrl-D) where no other door can decide the card: waiting
        # there left `kazma demo --terminal` silent until the deadline, with nothing left to type into.
        self.end_of_input = end_of_input
        self.auto = auto
        self.chat = chat
        self._ids = itertools.count(1)
        self._handlers: Handlers | None = None
        self._presses = Supervisor("terminal_task")  # each card waiting for a keypress

    @property
    def home_chat(self) -> str | None:
        return self.chat

    async def start(self, handlers: Handlers) -> None:
        self._handlers = handlers

    async def stop(self) -> None:
        await self._presses.stop()

    def _print(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    async def send(self, to: Address, message: Outgoing) -> str:
        """Printed: a text, or a question with its choices' labels under it (answered in the console or the chat
        it came from); the terminal posts no files."""
        refuse_elsewhere(self.name, to)
        if message.file is not None:
            raise PlatformError(self.name, "send_file", "the terminal posts no files", retryable=False)
        labels = "  ".join(f"[{label}]" for label, _ in message.choices)
        return await self.send_text(
            to.chat, f"{message.text}\n{labels}" if labels else message.text, agent=message.agent
        )

    async def send_text(self, chat: str, text: str, *, agent: str | None = None, thread: str | None = None) -> str:
        message_id = str(next(self._ids))
        who = reveal_line(agent or "kazma")
        # Escaped like a card's values: an ANSI sequence in an agent's words could move the cursor up and rewrite
        # a card already printed above.
        body = textwrap.indent(reveal(text), " " * (len(who) + 3)).lstrip()
        self._print(f"[{who}] {body}")
        return message_id

    async def post_card(self, card: ApprovalCard) -> CardRef:
        message_id = str(next(self._ids))
        shown = card if self.link_note is None else dataclasses.replace(card, link=self.link_note)
        laid = lay_out(shown, PlainWriter(frame="│ "))
        self._print(f"┌─ request {card.request_id}\n{laid.written}\n└─")
        self._presses.spawn(self._press(card, approve_here=laid.whole), name=f"terminal-press-{card.request_id}")
        return CardRef(self.name, self.chat, message_id, whole=laid.whole)

    async def _press(self, card: ApprovalCard, *, approve_here: bool) -> None:
        if self.interactive:
            if approve_here:
                # Only a/approve approves: anything else but d/deny was read as Approve, so "n", "no", an empty
                # Enter or the end of input (Ctrl-D) let a dangerous call run. It is asked again; at the end of
                # input ``end_of_input`` is pressed, or nothing (the console, or the deadline, decides).
                chosen = None
                while chosen is None:
                    answer = await _read_line(f"approve or deny {card.tool}? [a/d] ")
                    if answer is None:
                        if self.end_of_input is None:
                            self._print(f"\n(end of input: nothing pressed here; decide {card.tool} on its page)")
                            return
                        self._print(f"\n(end of input: pressing {self.end_of_input.value}, nothing else can here)")
                        chosen = self.end_of_input
                    else:
                        chosen = _ANSWERS.get(answer.strip().lower())
                decision = chosen
            else:
                answer = await _read_line(f"deny {card.tool} here, or approve it on its page? [d] ")
                if answer is None or _ANSWERS.get(answer.strip().lower()) is not Decision.DENY:
                    return
                decision = Decision.DENY
        elif self.auto is not None:
            decision = self.auto
            self._print(f"(no terminal attached: pressing {decision.value} as cli:{self.login})")
        else:
            return  # someone presses elsewhere (the web console)
        assert self._handlers is not None
        result = await self._handlers.on_press(
            Press(self.name, card.button_data(decision), str(Actor("cli", self.login)), self.chat, None)
        )
        self._print(f"  → {result.message}")

    async def settle_card(self, ref: CardRef, card: ApprovalCard, outcome: Outcome) -> None:
        self._presses.cancel()  # decided elsewhere: stop waiting for a keypress
        self._print(f"[card {card.request_id}] {reveal_line(outcome.summary())}; its buttons are gone")


def stdin_is_terminal() -> bool:
    """Whether a person can type here: with standard input closed (``kazma demo 0<&-``) ``sys.stdin`` is None."""
    return sys.stdin is not None and sys.stdin.isatty()


_ANSWERS = {"a": Decision.APPROVE, "approve": Decision.APPROVE, "d": Decision.DENY, "deny": Decision.DENY}


async def _read_line(prompt: str) -> str | None:
    """``input()`` on a daemon thread: a decision made elsewhere must not leave the process waiting for Enter.
    None at the end of input."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[str | None] = loop.create_future()

    def read() -> None:
        line: str | None
        try:
            line = input(prompt)
        except EOFError:
            line = None
        loop.call_soon_threadsafe(_resolve, answer, line)

    threading.Thread(target=read, name="kazma-terminal-press", daemon=True).start()
    return await answer


def _resolve(future: asyncio.Future[str | None], value: str | None) -> None:
    if not future.done():  # cancelled when the card was decided elsewhere
        future.set_result(value)
