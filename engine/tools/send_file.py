"""``send_file(path)``: an agent posts a file from its conversation's workspace back into the conversation.

Classified ``write`` (it shows people something, it changes nothing on the host). The path is confined
to the workspace exactly as ``read_file`` confines it: resolved inside the workspace's real path, every
parent opened without following links, a link or a file with other names (hard links) refused.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from collections.abc import Awaitable, Callable
from typing import Final

import structlog
from pydantic import Field

from kazma.config.limits import MIB
from kazma.config.models import DangerLevel
from kazma.engine.tools.registry import Tool, ToolArgs, ToolResult
from kazma.engine.tools.workspace import (
    PathRefused,
    ToolContext,
    WorkspacePath,
    _inside,
    _open_parent,
    _os_refusal,
    _refuse_hard_links,
    _workspace_root,
)

log = structlog.get_logger("kazma.engine.send_file")

# (conversation, file name, content, agent) -> the posted message's id, or None when the platform failed
FilePoster = Callable[[str, str, bytes, str], Awaitable[str | None]]
DEFAULT_MAX_BYTES: Final = 10 * MIB  # within every platform's upload limit for bots (Discord's is the lowest)


class SendFileArgs(ToolArgs):
    path: WorkspacePath = Field(
        description="Path of a file in the workspace (relative to it) to post into this conversation."
    )


class SendFileTool(Tool[SendFileArgs]):
    name = "send_file"
    description = (
        "Post a file from the conversation's workspace into this conversation, so the people here can download "
        "it (paths are relative to the workspace)."
    )
    default_level = DangerLevel.WRITE
    changes_state = True  # a posted file cannot be unposted: never retried blindly
    Args = SendFileArgs

    def __init__(self, poster: FilePoster, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.poster = poster
        self.max_bytes = max_bytes

    async def run(self, args: SendFileArgs, ctx: ToolContext) -> ToolResult:
        try:
            name, data = await asyncio.to_thread(self._read, ctx, args.path)
        except PathRefused as exc:
            log.info("send_file.refused", conversation=ctx.conversation, path=args.path[:200], reason=str(exc))
            return ToolResult(ok=False, output="", error=str(exc))
        message_id = await self.poster(ctx.conversation, name, data, ctx.agent)
        if message_id is None:
            return ToolResult(
                ok=False, output="", error=f"the platform did not accept {name}; it was not posted", changed_state=True
            )
        return ToolResult(
            ok=True, output=f"posted {name} ({len(data)} bytes) into the conversation", changed_state=True
        )

    def _read(self, ctx: ToolContext, raw: str) -> tuple[str, bytes]:
        root = _workspace_root(ctx)
        parts = _inside(root, raw)
        parent, _ = _open_parent(root, parts, create=False)
        shown = "/".join(parts)
        try:
            try:
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
            except FileNotFoundError:
                raise PathRefused(f"no such file: {shown!r}") from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise PathRefused(f"{shown!r} is a symbolic link; refused") from exc
                raise _os_refusal(shown, exc) from exc
        finally:
            os.close(parent)
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise PathRefused(f"{shown!r} is not a regular file")
            refused = _refuse_hard_links(shown, info)
            if refused is not None:
                raise PathRefused(refused)
            if info.st_size > self.max_bytes:
                raise PathRefused(f"{shown!r} is {info.st_size} bytes; at most {self.max_bytes} can be posted")
            data = handle.read(self.max_bytes + 1)
        if not data:
            raise PathRefused(f"{shown!r} is empty; there is nothing to post")
        if len(data) > self.max_bytes:
            raise PathRefused(f"{shown!r} grew past {self.max_bytes} bytes; not posted")
        return parts[-1], data
