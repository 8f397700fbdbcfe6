"""Files people send with a message, saved into the conversation's workspace and named for the agent.

The adapter kit already refused messages over the ``files:`` bounds and made every fetch refuse more
than ``files.max_bytes``; here the bytes are written under ``incoming/`` with a name that cannot leave
the workspace (no separators, no leading dots, no links followed), never over an existing file.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from kazma.adapters.contract import Attachment
from kazma.engine.tools.workspace import ToolContext, _open_parent, _workspace_root

log = structlog.get_logger("kazma.engine.attachments")

INCOMING: Final = "incoming"
_UNSAFE: Final = re.compile(r"[^A-Za-z0-9._ -]+")
_NAME_LIMIT: Final = 100


@dataclass(frozen=True)
class Saved:
    path: str  # relative to the workspace
    size: int


def safe_name(name: str) -> str:
    """The last path segment of ``name``, plain characters only, no leading dots, at most 100 characters."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    cleaned = _UNSAFE.sub("_", base).strip(" .") or "file"
    if len(cleaned) > _NAME_LIMIT:
        # The cut may fall after a blank or a dot: taken off again, as the whole name's were above. A name ending in
        # a blank is one no file tool takes (a card cannot show it), so the agent could not open what it was sent.
        stem, dot, ext = cleaned.rpartition(".")
        if dot and len(ext) < 12:
            cleaned = (stem[: _NAME_LIMIT - len(ext) - 1].rstrip(" .") or "file") + dot + ext
        else:
            cleaned = cleaned[:_NAME_LIMIT].rstrip(" .") or "file"
    return cleaned


def _write_new(workspace: Path, name: str, data: bytes) -> str:
    root = _workspace_root(ToolContext(workspace, ""))
    stem, dot, ext = name.rpartition(".")
    if not dot or not stem:
        stem, dot, ext = name, "", ""
    parent, _ = _open_parent(root, (INCOMING, name), create=True)
    try:
        for n in range(1, 1000):
            candidate = name if n == 1 else f"{stem}-{n}{dot}{ext}"
            try:
                fd = os.open(
                    candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=parent
                )
            except FileExistsError:
                continue  # never over a file already there: each message's files are kept
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            return f"{INCOMING}/{candidate}"
        raise FileExistsError(f"too many files named {name!r} in {INCOMING}/")
    finally:
        os.close(parent)


async def save_attachments(workspace: Path, attachments: Sequence[Attachment]) -> list[Saved]:
    """Fetch each file (bounded by the kit) and write it under ``incoming/``; all or nothing is reported."""
    saved: list[Saved] = []
    for attachment in attachments:
        data = await attachment.fetch()
        path = await asyncio.to_thread(_write_new, workspace, safe_name(attachment.name), data)
        saved.append(Saved(path, len(data)))
        log.info("attachments.saved", path=path, size=len(data))
    return saved


def describe(saved: Sequence[Saved]) -> str:
    """The line the agent reads after the message: which files arrived and where they are."""
    listed = ", ".join(f"{s.path} ({s.size} bytes)" for s in saved)
    return f"[Files sent with this message, saved in your workspace: {listed}]"
