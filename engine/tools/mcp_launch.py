"""How Kazma starts a stdio MCP server: inside bubblewrap, or on the host when its config says ``sandbox: none``.

An MCP server is someone else's code, started by Kazma as Kazma's user. In the
sandbox (the shell's, see :mod:`kazma.engine.tools.sandbox`) it sees:

* the system directories and a vetted part of ``/etc``, read-only;
* its own working directory, read-write, which is also its HOME
  (``<workspaces>/.mcp/<server>``: outside the store's folder, like the
  conversations' workspaces, and never a conversation's own);
* what it needs to run, read-only: its command as found on Kazma's PATH and
  every link on the way to the real file; for a file in a ``bin`` folder, that
  folder and the ``lib`` folders beside it (an interpreter's standard library,
  a virtualenv's site-packages; not the whole prefix, which may be a home
  folder); a virtualenv's ``pyvenv.cfg`` and the installation it names; the
  interpreter of a ``#!`` line, found the same way; and each file its ``args``
  name by absolute path;
* the paths its config lists under ``read_only`` and ``writable``.

It gets only the environment variables its config names, plus PATH (the
system's, with its command's folder first) and HOME (its working directory)
made by Kazma (and PWD, which bwrap sets) — and bwrap itself is started with that same environment, so
``/proc/1/environ`` inside says nothing more. The store's folder (the store,
the console's tokens, keys) and Kazma's configuration file stay absent even
when a listed path contains them, no other process is visible (its own PID
namespace and ``/proc``), and it has no network unless its config says
``network: true``.

``sandbox: none`` runs the server as a plain child process with the same
environment and working directory; then it can read everything Kazma's user
can, which every card of its tools says.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kazma.config.keyring import keys_folder
from kazma.config.models import KazmaConfig, MCPServerConfig
from kazma.engine.tools.sandbox import INSTALL_HINT, SANDBOX_PATH, Sandbox, SandboxRefused, probe_bwrap

__all__ = [
    "Launch",
    "LaunchRefused",
    "ServerPlaces",
    "places_for",
    "plan_launch",
    "server_sandbox",
    "unsandboxed_note",
]

# Where a command's installation never needs binding: these are bound for every sandbox anyway.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
_MAX_HOPS = 16  # links and "#!" interpreters followed from one command


class LaunchRefused(Exception):
    """The server cannot be started as its config asks (no bubblewrap, a missing command, a forbidden path)."""


@dataclass(frozen=True)
class ServerPlaces:
    """Where Kazma's stdio MCP servers work, and what none of them may ever see."""

    root: Path  # each server's own working directory is ``root/<server>``
    hidden: tuple[Path, ...] = field(default_factory=tuple)

    def workdir(self, server: str) -> Path:
        return self.root / server


def places_for(
    config: KazmaConfig, *, config_file: Path | None = None, workspace_root: Path | None = None
) -> ServerPlaces:
    """Beside the conversations' workspaces (a folder no conversation gets: theirs never start with a dot);
    the store's folder, the decision keys and the configuration file hidden."""
    root = workspace_root or config.tools.workspaces(config.store.path)
    hidden = [config.store.path.parent.resolve(), keys_folder(config.store.path).resolve()]
    if config_file is not None:
        hidden.append(config_file.resolve())
    return ServerPlaces(root=root / ".mcp", hidden=tuple(hidden))


@dataclass(frozen=True)
class Launch:
    """One start of a server: the argv, the whole environment (of bwrap too), the working directory."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    sandboxed: bool


def unsandboxed_note() -> str:
    return "This MCP server runs unsandboxed on this host."


def server_sandbox(config: MCPServerConfig) -> Sandbox:
    """The sandbox ``config``'s server runs in: bubblewrap (refusing to start without it), or none when chosen."""
    if config.sandbox == "none":
        return Sandbox(mode="none")
    probe = probe_bwrap()
    if probe.available:
        return Sandbox(mode="bwrap", binary=probe.path)
    return Sandbox(mode="bwrap", problem=probe.problem or "bubblewrap is unavailable")


def plan_launch(name: str, config: MCPServerConfig, places: ServerPlaces, sandbox: Sandbox) -> Launch:
    """How to start ``name`` now: creates its working directory; :class:`LaunchRefused` when it cannot start."""
    if sandbox.refuses:
        raise LaunchRefused(
            f"MCP server {name!r} runs in bubblewrap (mcp_servers.{name}.sandbox: bwrap), but {sandbox.problem}; "
            f"{INSTALL_HINT}, or set mcp_servers.{name}.sandbox: none to run it unsandboxed"
        )
    workdir = places.workdir(name)
    try:
        workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        workdir = workdir.resolve(strict=True)  # its HOME: absolute, whatever folder Kazma was started in
    except OSError as exc:
        raise LaunchRefused(f"MCP server {name!r}: cannot make its working directory {workdir}: {exc}") from exc
    found = shutil.which(config.command)
    if found is None:
        raise LaunchRefused(f"MCP server {name!r}: {config.command!r} was not found on PATH")
    command = os.path.abspath(found)  # not resolved: a virtualenv's python must keep its own path
    if not sandbox.active:
        env = _environment(config, path=os.environ.get("PATH", os.defpath), home=workdir)
        return Launch([command, *config.args], env, workdir, sandboxed=False)
    path = SANDBOX_PATH if _is_system(command) else f"{os.path.dirname(command)}:{SANDBOX_PATH}"
    env = _environment(config, path=path, home=workdir)
    # What it was given to change stays changeable: a log file named in its args, inside a writable folder.
    writable = [w.resolve() for w in config.writable]
    needs = [
        n for n in _needs(command, config.args, path) if not any(Path(n).resolve().is_relative_to(w) for w in writable)
    ]
    try:
        argv = sandbox.wrap(
            [command, *config.args],
            workspace=workdir,
            network=config.network,
            env=env,
            hidden=places.hidden,
            read_only=[*needs, *config.read_only],
            writable=config.writable,
        )
    except SandboxRefused as exc:
        raise LaunchRefused(f"MCP server {name!r}: {exc}") from exc
    return Launch(argv, env, workdir, sandboxed=True)


def _environment(config: MCPServerConfig, *, path: str, home: Path) -> dict[str, str]:
    """PATH and HOME made here, then the variables the config names (which win: naming one is a choice)."""
    env = {"PATH": path, "HOME": str(home)}
    env.update({var: os.environ[var] for var in config.env if var in os.environ})
    return env


def _is_system(path: str) -> bool:
    return any(path == top or path.startswith(top + "/") for top in _SYSTEM_DIRS)


def _needs(command: str, args: Sequence[str], path: str) -> list[str]:
    """The paths ``command`` needs to start: its links, installations and ``#!`` interpreters; files in ``args``."""
    found: list[str] = []
    queue, seen = [command, os.path.realpath(command)], set[str]()
    while queue and len(seen) < _MAX_HOPS:
        current = os.path.normpath(queue.pop(0))
        if current in seen:
            continue
        seen.add(current)
        found.extend(_installation(current))
        if os.path.islink(current):
            queue.append(os.path.join(os.path.dirname(current), os.readlink(current)))
        else:
            interpreter = _interpreter(current, path)
            if interpreter is not None:
                queue.append(interpreter)
    found.extend(arg for arg in args if os.path.isabs(arg) and os.path.isfile(arg))
    return list(dict.fromkeys(found))


def _installation(path: str) -> list[str]:
    """What must be visible for ``path`` to run: its ``bin`` folder and the ``lib`` folders beside it, or itself."""
    if _is_system(path):
        return []
    folder = os.path.dirname(path)
    if os.path.basename(folder) != "bin":
        return [path]
    prefix = os.path.dirname(folder)
    found = [folder, *_existing(os.path.join(prefix, entry) for entry in ("lib", "lib64", "pyvenv.cfg"))]
    home = _venv_home(os.path.join(prefix, "pyvenv.cfg"))
    if home is not None and not _is_system(home):
        base = os.path.dirname(os.path.normpath(home))
        found += _existing([home, os.path.join(base, "lib"), os.path.join(base, "lib64")])
    return found


def _existing(paths: Iterable[str]) -> list[str]:
    return [p for p in paths if os.path.exists(p)]


def _venv_home(config_file: str) -> str | None:
    """The ``home`` a virtualenv's ``pyvenv.cfg`` names (the base interpreter's folder), if any."""
    try:
        with open(config_file, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, sep, value = line.partition("=")
                if sep and key.strip() == "home" and os.path.isabs(value.strip()):
                    return value.strip()
    except OSError:
        return None
    return None


def _interpreter(path: str, search: str) -> str | None:
    """The program a ``#!`` line names (``env NAME`` looked up on ``search``, the PATH the server gets)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].decode("utf-8", errors="replace").split()
    if not words:
        return None
    if os.path.basename(words[0]) != "env":
        return words[0]
    name = next((word for word in words[1:] if not word.startswith("-") and "=" not in word), None)
    return None if name is None else shutil.which(name, path=search)
