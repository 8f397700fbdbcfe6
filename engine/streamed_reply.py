"""A reply shown while the model writes it: posted once there is text, edited as more arrives, ended exactly.

The model client hands each reply's text so far to :meth:`StreamedReply.grew` (see :mod:`answer_stream`); one
task shows the newest text whenever the last edit is done, so edits never queue up behind each other and each
waits its turn in the platform's pacing (the adapter's). :meth:`StreamedReply.finish` ends it with the turn's
final text, exactly once: an edit of what was shown, or, when nothing was shown or showing failed, the text
posted whole as a reply without streaming would be. The transcript keeps the final text only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol, cast

import structlog

from kazma.adapters.human_text import for_humans
from kazma.config.address import Address
from kazma.config.outgoing import Outgoing

log = structlog.get_logger("kazma.conversation")

Shown = list[tuple[str, str]]  # (message id, the part it shows), in order


class ShowingSink(Protocol):
    def can_show(self, at: Address) -> bool: ...

    async def show(self, to: Address, shown: Sequence[tuple[str, str]], message: Outgoing) -> Shown | None: ...

    async def send(self, to: Address, message: Outgoing) -> str | None: ...


def stream_at(sink: object, at: Address, agent: str | None) -> StreamedReply | None:
    """A reply at ``at`` shown growing through ``sink``; None where it cannot be (no platform edit path)."""
    can = getattr(sink, "can_show", None)
    if can is None or getattr(sink, "show", None) is None or not can(at):
        return None
    return StreamedReply(cast(ShowingSink, sink), at, agent)


class StreamedReply:
    def __init__(self, sink: ShowingSink, where: Address, agent: str | None) -> None:
        self.sink = sink
        self.where = where
        self.agent = agent
        self.shown: Shown = []
        self._text = ""  # the reply's text so far, as people read it
        self._shown_text = ""
        self._said: str | None = None  # a reply that turned to tools: its words, to be shown as they ended
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.broken = False  # showing failed: nothing more is shown until the final text is posted whole

    # -- AnswerStream ---------------------------------------------------------------------------------

    def grew(self, text: str) -> None:
        if self._closed or self.broken:
            return
        self._text = for_humans(text.strip())
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._show_loop(), name=f"stream-{self.where.conversation}")

    def dropped(self) -> None:
        # The model wrote words, then asked for tools: its words stay as they ended; the next reply starts anew.
        if self._closed or self.broken:
            return
        self._said, self._text = self._text, ""
        self._wake.set()

    # -- showing -------------------------------------------------------------------------------------

    async def _show_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._said is not None:
                said, self._said = self._said, None
                if said and said != self._shown_text:
                    await self._show(said)
                if self.shown and not self.broken:
                    await self._keep(said)
                self.shown, self._shown_text = [], ""
            if self._closed or self.broken:
                return
            text = self._text
            if text and text != self._shown_text:
                await self._show(text)

    async def _show(self, text: str) -> bool:
        now = await self.sink.show(self.where, self.shown, Outgoing(text, agent=self.agent))
        if now is None:
            self.broken = True  # counted where it failed (the adapter, the bus); the final text goes out whole
            log.warning("conversation.stream_broken", conversation=self.where.conversation, shown=len(self.shown))
            return False
        self.shown, self._shown_text = now, text
        return True

    async def _keep(self, text: str) -> None:
        keep = getattr(self.sink, "keep", None)
        if keep is not None and self.shown:
            await keep(self.where, Outgoing(text, agent=self.agent), self.shown[0][0])

    # -- the end -------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop showing (what was shown stays); waits for an edit in flight."""
        self._closed = True
        self._wake.set()
        if self._task is not None:
            try:
                await self._task
            except Exception as exc:  # whatever broke the showing, the final text still goes out, whole
                self.broken = True
                log.warning("conversation.stream_failed", conversation=self.where.conversation, error=str(exc))

    async def finish(self, text: str) -> str | None:
        """End with ``text`` (the turn's final words, for people): exactly once; the first message's id."""
        await self.close()
        final = for_humans(text)
        if self.shown and not self.broken and await self._show(final):
            await self._keep(final)
            log.info("conversation.stream_finished", conversation=self.where.conversation, parts=len(self.shown))
            return self.shown[0][0]
        return await self.sink.send(self.where, Outgoing(final, agent=self.agent))
