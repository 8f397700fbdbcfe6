"""What Kazma posts into a conversation: one value along the whole send path.

The engine says what (:class:`Outgoing`) and where (:class:`~kazma.config.address.Address`); the transcript,
the bus and the platform's adapter pass both on as they are (one input value per call, as Temporal's
interceptors take theirs), so a new thing to say about a message is a field here, not a parameter added at
every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class OutgoingFile:
    name: str
    data: bytes = field(repr=False)


@dataclass(frozen=True)
class Outgoing:
    """Text; or a question with one button per ``(label, data)``; or a file. Posted as ``agent`` (None: Kazma)."""

    text: str = ""
    choices: tuple[tuple[str, str], ...] = ()
    file: OutgoingFile | None = None
    agent: str | None = None

    @classmethod
    def question(cls, text: str, choices: Sequence[tuple[str, str]], *, agent: str | None = None) -> Outgoing:
        return cls(text, tuple(choices), agent=agent)

    @classmethod
    def of_file(cls, name: str, data: bytes, *, agent: str | None = None) -> Outgoing:
        return cls(file=OutgoingFile(name, data), agent=agent)

    @property
    def kind(self) -> str:
        """ "file", "choices" or "text": the call site's name in logs and failure counters."""
        return "file" if self.file is not None else "choices" if self.choices else "text"

    def as_people_read_it(self) -> str:
        """What the transcript keeps: the text, a question's choices under it, a file's name and size."""
        if self.file is not None:
            return f"{self.file.name} ({len(self.file.data)} bytes)"
        labels = " · ".join(label for label, _ in self.choices)
        return f"{self.text}\n[{labels}]" if labels else self.text
