"""The swarm's size limits, in one place: every surface refuses with the same words, naming the limit.

A task's prompt, the context it carries to its workers and its metadata (every
other field of the request: workers, routes, options) are refused when over
their limit, before anything runs. A pipeline whose blackboard (the earlier
stages' answers, handed to the next stage) grows past the context limit fails
that stage saying so: nothing is ever cut without a word.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kazma.config.limits import KIB

MAX_PROMPT_BYTES = 64 * KIB
MAX_CONTEXT_BYTES = 256 * KIB
MAX_METADATA_BYTES = 64 * KIB
# A whole /swarm command as a form sends it: a task of up to MAX_PROMPT_BYTES and the words around it.
MAX_COMMAND_BYTES = MAX_PROMPT_BYTES + KIB

LIMITS: Mapping[str, int] = {
    "prompt": MAX_PROMPT_BYTES,
    "context": MAX_CONTEXT_BYTES,
    "metadata": MAX_METADATA_BYTES,
}


class LimitExceeded(ValueError):
    """Something is over its size limit; ``str()`` is the sentence a person reads."""

    def __init__(self, what: str, size: int, limit: int, hint: str = "") -> None:
        self.what = what
        self.size = size
        self.limit = limit
        tail = f" — {hint}" if hint else ""
        super().__init__(
            f"the {what} is {size:,} bytes; the limit is {limit:,} bytes ({limit // KIB} KiB) of UTF-8{tail}"
        )


def utf8_size(text: str) -> int:
    return len(text.encode("utf-8", errors="surrogatepass"))


def check_prompt(text: str, *, word: str = "task") -> None:
    size = utf8_size(text)
    if size > MAX_PROMPT_BYTES:
        raise LimitExceeded(word, size, MAX_PROMPT_BYTES, "shorten it or point to a file instead")


def check_context(text: str, *, what: str = "context") -> None:
    size = utf8_size(text)
    if size > MAX_CONTEXT_BYTES:
        raise LimitExceeded(what, size, MAX_CONTEXT_BYTES, "nothing was cut; pass less, or a file's name instead")


def metadata_size(metadata: Mapping[str, Any]) -> int:
    """The size of the request's metadata as it is stored (compact JSON)."""
    return utf8_size(json.dumps(metadata, ensure_ascii=False, separators=(",", ":"), sort_keys=True, default=str))


def check_metadata(metadata: Mapping[str, Any]) -> None:
    size = metadata_size(metadata)
    if size > MAX_METADATA_BYTES:
        raise LimitExceeded(
            "task's metadata (workers, routes and options)", size, MAX_METADATA_BYTES, "name fewer or shorter ones"
        )
