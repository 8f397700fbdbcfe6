"""Where a tool call runs (:class:`ToolContext`) and how a path a model wrote stays inside its workspace.

File paths are confined to the real path of the conversation's workspace:
symbolic links are resolved and checked, directories are opened one
component at a time without following links, and a file with other names
(hard links) is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import structlog
from pydantic import AfterValidator

log = structlog.get_logger("kazma.engine.tools")


@dataclass(frozen=True)
class ToolContext:
    """Where a call runs: ``workspace`` is the conversation's own directory, created on first use.

    ``approved_hash``: the argument hash a person approved for this call (None when it needed no approval); the
    registry hashes what is about to run against it before any tool runs, and a tool that sends its arguments
    elsewhere (MCP) re-hashes the very payload it sends too.

    ``definition_hash``: the digest of the tool's definition as its card showed it (None: a tool fixed in Kazma's
    code); the registry compares the tool it is about to run with it, with nothing awaited between the two.
    """

    workspace: Path
    conversation: str
    approved_hash: str | None = None
    agent: str = ""  # who calls (files an agent posts are shown under its name)
    definition_hash: str | None = None

    def ensure_workspace(self) -> Path:
        """Create the workspace if needed and return its real path; :class:`PathRefused` when it is a symlink."""
        return _workspace_root(self)


class PathRefused(Exception):
    """A path the model asked for that the tool will not touch; the message is shown to the model."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _workspace_root(ctx: ToolContext) -> Path:
    """The workspace's real path, created when missing; refused when the workspace itself is a symbolic link.

    Paths are confined to the real path of the root, so a root that is a link
    would confine them to wherever the link points (and whoever can replace
    the link chooses that). It is checked before it is created or used.
    """

    def check() -> None:
        info = os.lstat(ctx.workspace)
        if stat.S_ISLNK(info.st_mode):
            raise PathRefused("the workspace directory is a symbolic link; refused (it must be a real directory)")
        if not stat.S_ISDIR(info.st_mode):
            raise PathRefused("the workspace is not a directory; refused")

    try:
        try:
            check()
        except FileNotFoundError:
            ctx.workspace.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            ctx.workspace.mkdir(mode=0o700, exist_ok=True)
            check()
        _private(ctx.workspace.parent)
        return ctx.workspace.resolve(strict=True)
    except OSError as exc:
        raise PathRefused(f"the workspace directory cannot be used: {exc.strerror or exc}") from exc


def _private(root: Path) -> None:
    """The folder holding the workspaces reachable by Kazma's user alone.

    A sandboxed command runs as Kazma's user without capabilities, but may still ``chmod u+s`` a file it made
    (the mount is nosuid only inside the sandbox), or open its own workspace to everyone: a setuid program any
    local user could run as Kazma's user (as root, when Kazma runs as root). The workspaces' folder is outside
    every sandbox, so behind it nobody else reaches what a command left. Tightened once when found open.

    A folder others share on purpose (the sticky bit: /tmp and the like), or one of another user, is never changed:
    it is said instead (``tools.workspace_root_shared``), once a process; the README says to name a folder of
    Kazma's own."""
    info = os.stat(root)
    if not info.st_mode & 0o077:
        return
    if info.st_uid != os.geteuid() or info.st_mode & stat.S_ISVTX:
        if str(root) not in _SAID_SHARED:
            _SAID_SHARED.add(str(root))
            log.warning(
                "tools.workspace_root_shared",
                root=str(root),
                mode=oct(stat.S_IMODE(info.st_mode)),
                detail="other users can reach what commands leave in the workspaces (a setuid program among them): "
                "set tools.workspace_root to a folder of Kazma's own",
            )
        return
    os.chmod(root, 0o700)
    log.warning("tools.workspace_root_tightened", root=str(root), was=oct(stat.S_IMODE(info.st_mode)))


_SAID_SHARED: set[str] = set()  # shared workspace folders already warned about in this process


def _refuse_hard_links(shown: str, info: os.stat_result) -> str | None:
    """Why a file with several names is refused, or None when it has one.

    A shell call can hard-link a file from outside the workspace into it
    (``ln /elsewhere/file ws/x``); the link is a regular file, not a symlink,
    so only the link count shows that the same file has another name.
    """
    if info.st_nlink <= 1:
        return None
    return (
        f"{shown!r} has {info.st_nlink} hard links (other names for the same file, possibly outside the "
        "workspace); refused"
    )


def _os_refusal(shown: str, exc: OSError) -> PathRefused:
    """What an operating-system error on a workspace path says to the model.

    A command can leave anything in its workspace: a socket (opening it fails with ENXIO), a name too long
    for the file system, a folder it made unreadable. Each ended the call as a crash ("failed unexpectedly",
    a traceback logged as ``tool.crashed``) though it is only a path the tool cannot use."""
    if exc.errno in (errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):
        return PathRefused(f"{shown!r} is not a regular file (a socket or a device); refused")
    if exc.errno == errno.ENAMETOOLONG:
        return PathRefused(f"{shown!r}: a name in the path is too long for the file system")
    return PathRefused(f"{shown!r} cannot be used: {exc.strerror or exc}")


def normal_path(raw: str) -> str:
    """``raw`` when it is written the one way it runs, else :class:`ValueError` saying how to write it.

    A card shows a path as the model sent it and the tool then opens the file it resolves to: ``notes/`` wrote
    ``notes``, ``a/../b`` wrote ``b``. Refused here, before any card (not rewritten): the call that is approved,
    audited and run, and what the model believes it asked for, are then one and the same text."""
    if not raw or "\x00" in raw:
        raise ValueError("expected a file path relative to the workspace")
    control = next((c for c in raw if unicodedata.category(c) == "Cc"), None)
    if control is not None:
        raise ValueError(f"{raw!r} contains a control character ({control!r}); name the file without it")
    # Blanks at either end of a name are the one difference a card cannot show ("notes.txt " reads "notes.txt"),
    # and the card's own checks let trailing blanks pass: in a command they change nothing, in a file name all.
    padded = next((part for part in raw.split("/") if part != part.strip()), None)
    if padded is not None:
        raise ValueError(f"{raw!r}: the name {padded!r} begins or ends with blank space; name the file without it")
    normal = posixpath.normpath(raw)
    if normal.startswith("//"):  # kept by normpath (POSIX leaves a leading "//" to the system); it names "/"
        normal = "/" + normal.lstrip("/")
    if normal == ".":
        raise ValueError(f"{raw!r} names the workspace directory itself, not a file")
    if normal == ".." or normal.startswith("../"):
        raise ValueError(f"{raw!r} is outside the workspace; use a path relative to the workspace")
    if ".." in raw.split("/"):
        # No rewrite offered: "docs/.." is where the link "docs" points up from, not the folder holding "docs".
        raise ValueError(f"{raw!r} contains '..'; name the file by its path from the workspace down, without '..'")
    if normal != raw:
        raise ValueError(
            f"{raw!r} is not written the way it would run: write {normal!r} (no '.' or empty parts, no '/' at "
            "the end), so that what is shown is the very file used"
        )
    return raw


WorkspacePath = Annotated[str, AfterValidator(normal_path)]
"""A tool argument naming a file in the workspace, refused unless written in normal form (:func:`normal_path`)."""


def _inside(root: Path, raw: str, *, as_named: bool = False) -> tuple[str, ...]:
    """The components, relative to ``root``, of the real path ``raw`` names; refused if it leaves ``root``.

    ``as_named``: refused too when reaching it goes through a symbolic link at all. A write is approved for the
    path its card shows; ``notes.txt -> .git/hooks/post-checkout``, planted by a cloned repository or an
    earlier call, would have it write a file nobody was shown."""
    if not raw or "\x00" in raw:
        raise PathRefused("expected a file path relative to the workspace")
    candidate = Path(raw)
    target = candidate if candidate.is_absolute() else root / candidate
    try:
        resolved = target.resolve()
    except (OSError, RuntimeError) as exc:  # 3.11 raises RuntimeError on symlink loops
        raise PathRefused(f"{raw!r} cannot be resolved: {exc}") from exc
    named = Path(os.path.normpath(target))
    if not resolved.is_relative_to(root):
        if named.is_relative_to(root):
            raise PathRefused(f"{raw!r} leads outside the workspace through a symbolic link")
        raise PathRefused(f"{raw!r} is outside the workspace; use a path relative to the workspace")
    parts = resolved.relative_to(root).parts
    if as_named and resolved != named:
        raise PathRefused(
            f"{raw!r} goes through a symbolic link (to {'/'.join(parts)!r}): it would write somewhere other than it "
            "says; name the real path"
        )
    if not parts:
        raise PathRefused(f"{raw!r} names the workspace directory itself, not a file")
    return parts


def _open_parent(root: Path, parts: tuple[str, ...], *, create: bool) -> tuple[int, bool]:
    """Open the directory holding ``parts[-1]`` one component at a time without following symlinks.

    ``_inside`` already resolved every symlink, so a symlink met here was put
    there since (for example by a concurrent shell call); refusing it closes
    that race instead of following it out of the workspace. Returns the
    directory's fd and whether any directory was created.
    """
    created = False
    fd = os.open(root, _DIR_FLAGS)
    try:
        for name in parts[:-1]:
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)
                    created = True
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except OSError as exc:
        os.close(fd)
        shown = "/".join(parts)
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PathRefused(f"{shown!r}: a parent is not a directory (or changed into a symbolic link)") from exc
        if isinstance(exc, FileNotFoundError):
            raise PathRefused(f"no such file: {shown!r}") from exc
        raise _os_refusal(shown, exc) from exc
    return fd, created
