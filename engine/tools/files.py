"""The ``read_file`` and ``write_file`` tools: UTF-8 text inside the workspace, never through a link out of it."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import errno
import os
import secrets
import stat

from pydantic import Field

from kazma.config.limits import KIB, MIB
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


class ReadFileArgs(ToolArgs):
    path: WorkspacePath = Field(description="Path of a text file, relative to the workspace.")


class ReadFileTool(Tool[ReadFileArgs]):
    name = "read_file"
    description = "Read a UTF-8 text file from the conversation's workspace (paths are relative to the workspace)."
    default_level = DangerLevel.READ
    Args = ReadFileArgs

    def __init__(self, *, max_bytes: int = 256 * KIB) -> None:
        self.max_bytes = max_bytes

    async def run(self, args: ReadFileArgs, ctx: ToolContext) -> ToolResult:
        return await asyncio.to_thread(self._read, ctx, args.path)

    def _read(self, ctx: ToolContext, raw: str) -> ToolResult:
        try:
            root = _workspace_root(ctx)
            parts = _inside(root, raw)
            parent, _ = _open_parent(root, parts, create=False)
        except PathRefused as exc:
            return ToolResult(ok=False, output="", error=str(exc))
        shown = "/".join(parts)
        try:
            try:
                # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
            except FileNotFoundError:
                return ToolResult(ok=False, output="", error=f"no such file: {shown!r}")
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    return ToolResult(ok=False, output="", error=f"{shown!r} changed into a symbolic link; refused")
                return ToolResult(ok=False, output="", error=str(_os_refusal(shown, exc)))
        finally:
            os.close(parent)
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if stat.S_ISDIR(info.st_mode):
                return ToolResult(ok=False, output="", error=f"{shown!r} is a directory, not a file")
            if not stat.S_ISREG(info.st_mode):
                return ToolResult(ok=False, output="", error=f"{shown!r} is not a regular file")
            # Counted on the open file itself: what is read below is the file whose names were counted.
            refused = _refuse_hard_links(shown, info)
            if refused is not None:
                return ToolResult(ok=False, output="", error=refused)
            data = handle.read(self.max_bytes + 1)
        truncated = len(data) > self.max_bytes
        data = data[: self.max_bytes]
        try:
            # Not final when cut: a multi-byte character split by the cap is not a sign of binary data.
            text = codecs.getincrementaldecoder("utf-8")().decode(data, final=not truncated)
        except UnicodeDecodeError:
            return ToolResult(ok=False, output="", error=f"{shown!r} is a binary file (not UTF-8 text); not shown")
        if "\x00" in text:
            return ToolResult(ok=False, output="", error=f"{shown!r} is a binary file (contains NUL bytes); not shown")
        if truncated:
            text += f"\n[… file is {info.st_size} bytes; only the first {self.max_bytes} are shown …]"
        return ToolResult(ok=True, output=text, truncated=truncated)


class WriteFileArgs(ToolArgs):
    path: WorkspacePath = Field(
        description="Path of the file to write, relative to the workspace. Parents are created."
    )
    content: str = Field(description="The whole new content of the file (UTF-8 text).")


class WriteFileTool(Tool[WriteFileArgs]):
    name = "write_file"
    description = (
        "Write a UTF-8 text file in the conversation's workspace, replacing it whole if it exists "
        "(paths are relative to the workspace; missing parent directories are created)."
    )
    default_level = DangerLevel.DANGEROUS
    changes_state = True
    Args = WriteFileArgs

    def __init__(self, *, max_bytes: int = MIB) -> None:
        self.max_bytes = max_bytes

    async def run(self, args: WriteFileArgs, ctx: ToolContext) -> ToolResult:
        return await asyncio.to_thread(self._write, ctx, args.path, args.content)

    def _write(self, ctx: ToolContext, raw: str, content: str) -> ToolResult:
        data = content.encode("utf-8")
        if len(data) > self.max_bytes:
            return ToolResult(
                ok=False, output="", error=f"content is {len(data)} bytes; the limit is {self.max_bytes} bytes"
            )
        try:
            root = _workspace_root(ctx)
            parts = _inside(root, raw, as_named=True)
            parent, created = _open_parent(root, parts, create=True)
        except PathRefused as exc:
            return ToolResult(ok=False, output="", error=str(exc))
        shown = "/".join(parts)
        name = parts[-1]
        try:
            try:
                existing = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                mode = None
            except OSError as exc:
                return ToolResult(ok=False, output="", error=str(_os_refusal(shown, exc)), changed_state=created)
            else:
                if stat.S_ISDIR(existing.st_mode):
                    return ToolResult(
                        ok=False, output="", error=f"{shown!r} is a directory, not a file", changed_state=created
                    )
                if not stat.S_ISREG(existing.st_mode):
                    return ToolResult(
                        ok=False,
                        output="",
                        error=f"{shown!r} exists and is not a regular file; refused",
                        changed_state=created,
                    )
                # The rename below only replaces this name, so a link made after this check
                # still never has its other name written through.
                refused = _refuse_hard_links(shown, existing)
                if refused is not None:
                    return ToolResult(ok=False, output="", error=refused, changed_state=created)
                mode = stat.S_IMODE(existing.st_mode)
            # Write a temporary sibling and rename it over the target: readers see
            # the old file or the new one, never a half-written one.
            temp = f".kazma-{secrets.token_hex(8)}.tmp"
            try:
                fd = os.open(
                    temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=parent
                )
            except OSError as exc:
                return ToolResult(ok=False, output="", error=str(_os_refusal(shown, exc)), changed_state=created)
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    if mode is not None:
                        os.fchmod(handle.fileno(), mode)
                    os.fsync(handle.fileno())
                os.replace(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=parent)
                raise
            os.fsync(parent)
        finally:
            os.close(parent)
        return ToolResult(ok=True, output=f"wrote {len(data)} bytes to {shown}", changed_state=True)
