"""The fence: worker and tool output reaches a model as data inside a marked block, never as instructions.

:class:`Fenced` is text the fence made. Everything that hands worker or tool
output to a model takes a ``Fenced`` value (mypy checks the calls), and only
this module makes one: a guard test walks the engine for any other
``Fenced(...)`` and for model messages built inline from untyped strings.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from typing import NewType

from kazma.adapters.human_text import FENCE_BEGIN, FENCE_END, FENCE_HEADER

Fenced = NewType("Fenced", str)

NOTHING = Fenced("")  # no data at all: the empty context
_FENCE_SOURCE_LIMIT = 120
_CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]")


def fence_untrusted(text: str, *, source: str) -> Fenced:
    """Wrap tool or sub-agent output so that a model reads it as data, never as instructions.

    Output of a tool or another model may contain text written by anyone (a web
    page, a file, a prompt injection). Fencing it with fixed markers would let
    that text print the closing marker and continue "outside" the fence, so the
    markers carry a fresh random nonce chosen after the text is known (and
    re-drawn in the astronomically unlikely case the text contains it): the
    text cannot close a fence whose marker it could not have known.
    """
    label = " ".join(_CONTROL.sub(" ", source).split())[:_FENCE_SOURCE_LIMIT] or "an unnamed source"
    nonce = secrets.token_hex(12)
    while nonce in text:
        nonce = secrets.token_hex(12)
    begin = FENCE_BEGIN.format(nonce=nonce)
    end = FENCE_END.format(nonce=nonce)
    # People never see this: adapters.human_text.for_humans turns it into a quiet "from" label.
    header = FENCE_HEADER.format(label=label, begin=begin, end=end)
    body = text if text.endswith("\n") or not text else text + "\n"
    return Fenced(f"{header}\n{begin}\n{body}{end}")


def join_fenced(blocks: Iterable[Fenced], separator: str = "\n") -> Fenced:
    """Fenced blocks one after another are still only fenced blocks (the separator is a line break or blank)."""
    if separator.strip():
        raise ValueError("fenced blocks are joined by whitespace only")
    return Fenced(separator.join(block for block in blocks if block))
