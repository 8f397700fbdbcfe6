"""Running a shell command inside bubblewrap (``bwrap``), so that one approved call cannot reach Kazma.

The sandbox sees only what is bound into it: the system directories read-only,
a vetted handful of ``/etc`` entries read-only, a fresh ``/proc`` (read-only)
for its own PID namespace, a minimal ``/dev``, an empty ``/tmp`` and the
conversation's workspace read-write. Kazma's state directory, its tokens, the
home directories, ``/run``, ``/var`` and every other process are simply absent.
When the command's shell exits, the PID namespace ends and the kernel kills
every process started in it — also those that left the session (``setsid``).

Facts this module is built on (checked on Debian 12, bubblewrap 0.8, as root
and unprivileged):

* Started by root, bwrap keeps **all** capabilities for the command unless told
  otherwise; with them the command could mount a disk or make device nodes.
  ``--cap-drop ALL`` is therefore always passed (a no-op for other users).
* Even without capabilities a uid-0 command owns ``/proc/sys/*`` (global
  sysctls such as ``kernel.core_pattern``, which runs a program as host root):
  ``/proc`` is remounted read-only.
* ``/proc/1`` inside is bwrap's own init, whose environment is the one bwrap
  was *started* with: ``--clearenv`` alone leaks the launcher's variables, so
  callers must start bwrap with :meth:`Sandbox.environment`, never Kazma's.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import structlog

__all__ = [
    "INSTALL_HINT",
    "SANDBOX_MODES",
    "SANDBOX_PATH",
    "BwrapProbe",
    "Sandbox",
    "SandboxMode",
    "SandboxRefused",
    "bwrap_argv",
    "probe_bwrap",
    "resolve_sandbox",
    "sandbox_environment",
]

log = structlog.get_logger("kazma.engine.sandbox")

SandboxMode = Literal["auto", "bwrap", "none"]
SANDBOX_MODES: tuple[SandboxMode, ...] = get_args(SandboxMode)

INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora/RHEL: dnf install bubblewrap; "
    "Arch: pacman -S bubblewrap; Alpine: apk add bubblewrap)"
)

# Inside the sandbox only the system directories exist, so the launcher's PATH
# (virtualenvs, ~/.local/bin, /opt/...) would point nowhere; a fixed one is predictable.
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# The locale categories glibc knows; a fixed list rather than "LC_*", which would
# pass any variable someone happened to name LC_SOMETHING.
_LOCALE_VARS = (
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_ADDRESS",
    "LC_COLLATE",
    "LC_CTYPE",
    "LC_IDENTIFICATION",
    "LC_MEASUREMENT",
    "LC_MESSAGES",
    "LC_MONETARY",
    "LC_NAME",
    "LC_NUMERIC",
    "LC_PAPER",
    "LC_TELEPHONE",
    "LC_TIME",
)

# Bound read-only when they exist; a symbolic link (merged /usr: /bin -> usr/bin)
# is recreated as the same link instead of being bound.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")

# Not /etc as a whole: it holds secrets (shadow, ssl/private, ssh host keys,
# pip.conf/npmrc credentials, perhaps Kazma's own kazma.yaml), and a command run
# by a root Kazma is uid 0 inside, which owns those files even without
# capabilities. This is what ordinary commands need: name resolution and
# network configuration (DNS works when the network is on), CA certificates and
# OpenSSL configuration, users and groups without passwords (shadow stays out),
# the dynamic linker's cache, Debian's alternatives links, time zone, locale aliases,
# MIME and magic databases, git's system configuration.
_ETC_ALLOWED = (
    "/etc/alternatives",
    "/etc/crypto-policies",
    "/etc/gai.conf",
    "/etc/gitconfig",
    "/etc/group",
    "/etc/host.conf",
    "/etc/hosts",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/locale.alias",
    "/etc/localtime",
    "/etc/magic",
    "/etc/magic.mime",
    "/etc/mime.types",
    "/etc/netconfig",
    "/etc/networks",
    "/etc/nsswitch.conf",
    "/etc/os-release",
    "/etc/passwd",
    "/etc/pki/ca-trust/extracted",
    "/etc/pki/tls/cert.pem",
    "/etc/pki/tls/certs",
    "/etc/pki/tls/openssl.cnf",
    "/etc/protocols",
    "/etc/resolv.conf",
    "/etc/services",
    "/etc/ssl/cert.pem",
    "/etc/ssl/certs",
    "/etc/ssl/openssl.cnf",
    "/etc/timezone",
)

_PROBE_TIMEOUT_S = 15.0


class SandboxRefused(Exception):
    """This call cannot be sandboxed as asked (for example the workspace holds a hidden path); nothing runs."""


# --------------------------------------------------------------------------- environment


def sandbox_environment(home: Path, source: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a sandboxed command: PATH, HOME, locale and TZ from ``source``, nothing else."""
    source = os.environ if source is None else source
    env = {key: source[key] for key in (*_LOCALE_VARS, "TZ") if key in source}
    env["PATH"] = SANDBOX_PATH
    env["HOME"] = str(home)
    return env


# --------------------------------------------------------------------------- argv


def _real(path: Path | str) -> Path:
    return Path(os.path.realpath(path))


def _hidden_by(path: Path, hidden: Sequence[Path]) -> bool:
    return any(path.is_relative_to(h) for h in hidden)


def bwrap_argv(
    binary: str,
    command: Sequence[str],
    *,
    workspace: Path,
    network: bool,
    env: Mapping[str, str],
    hidden: Iterable[Path | str] = (),
    read_only: Iterable[Path | str] = (),
    writable: Iterable[Path | str] = (),
) -> list[str]:
    """The bwrap command line that runs ``command`` with ``workspace`` as its read-write cwd and HOME.

    ``hidden`` names paths the command must not see (Kazma's state directory,
    its configuration). Most of the host is absent anyway; where a hidden path
    would still show:

    * inside a read-only system bind (state under ``/usr/local`` or
      ``/etc/ssl/certs``): it is covered by an empty tmpfs (a directory) or
      ``/dev/null`` (a file). Read-only, the cover cannot be moved away;
    * a system bind inside a hidden path: that bind is left out;
    * inside the workspace, or the workspace itself: :class:`SandboxRefused`.
      A cover inside a writable tree is not reliable (the command can rename a
      parent of the cover between calls and find the state unmasked next time),
      and workspaces belong outside the state directory anyway;
    * the workspace inside a hidden path (the old ``<state>/workspaces/<id>``
      layout) is allowed: only the workspace itself is bound, its parents
      inside the sandbox are empty directories.

    ``read_only`` and ``writable`` are further existing paths bound at their
    own place (a tool's interpreter and packages, folders a server was given).
    Neither may lie inside a hidden path; a hidden path inside a read-only one
    is covered as above, inside a writable one it is :class:`SandboxRefused`.

    ``env`` becomes the command's whole environment (after ``--clearenv``);
    start bwrap itself with the same ``env`` (see the module's note on /proc/1).
    """
    workspace = _real(workspace)
    hidden_real = [_real(h) for h in hidden]
    for h in hidden_real:
        if workspace == h or h.is_relative_to(workspace):
            raise SandboxRefused(
                f"the workspace {workspace} contains {h}, which must stay hidden from tools; "
                "keep workspaces outside Kazma's state directory"
            )
    extra_ro = _extra_binds(read_only, hidden_real, writable=False)
    extra_rw = _extra_binds(writable, hidden_real, writable=True)
    argv = [binary, "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    if not network:
        argv.append("--unshare-net")
    argv += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    binds: list[tuple[Path, str]] = []  # (real source, path inside) of every read-only bind
    for entry in _SYSTEM_DIRS:
        if os.path.islink(entry):
            argv += ["--symlink", os.readlink(entry), entry]
        elif os.path.isdir(entry) and not _hidden_by(_real(entry), hidden_real):
            argv += ["--ro-bind", entry, entry]
            binds.append((_real(entry), entry))
    for entry in _ETC_ALLOWED:
        # Checked here, but bound with -try: an entry removed meanwhile is skipped, not fatal.
        if os.path.exists(entry) and not _hidden_by(_real(entry), hidden_real):
            argv += ["--ro-bind-try", entry, entry]
            binds.append((_real(entry), entry))
    argv += ["--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev"]
    argv += ["--tmpfs", "/tmp"]  # noqa: S108 - a fresh, private tmpfs inside the sandbox
    # Writable before read-only: a later mount hides what was mounted below it, so a
    # read-only path inside a writable one stays read-only only when it comes after.
    for path, _given in extra_rw:
        argv += ["--bind", str(path), str(path)]
    for path, _given in extra_ro:
        if not any(path.is_relative_to(source) for source, _inside in binds):
            argv += ["--ro-bind", str(path), str(path)]
            binds.append((path, str(path)))
    # Bound at their real place; a path given through a symbolic link gets the same link inside.
    visible = [Path(inside) for _source, inside in binds] + [path for path, _given in extra_rw]
    for path, given in dict.fromkeys([*extra_rw, *extra_ro]):
        if given != path and not any(given.is_relative_to(place) for place in visible):
            argv += ["--symlink", str(path), str(given)]
            visible.append(given)
    for h in hidden_real:
        for source, inside in binds:
            if h != source and h.is_relative_to(source) and os.path.lexists(h):
                cover = os.path.join(inside, h.relative_to(source))
                if os.path.isdir(h):
                    argv += ["--tmpfs", cover]
                else:
                    argv += ["--ro-bind", "/dev/null", cover]
    # Last, so that a workspace under /tmp (or a covered directory) is mounted on top.
    argv += ["--bind", str(workspace), str(workspace), "--chdir", str(workspace), "--clearenv"]
    for key, value in sorted(env.items()):
        argv += ["--setenv", key, value]
    return [*argv, "--", *command]


def _extra_binds(paths: Iterable[Path | str], hidden: Sequence[Path], *, writable: bool) -> list[tuple[Path, Path]]:
    """``paths`` as (real path, path as given), each checked against ``hidden``: none may lie inside a hidden path."""
    kind = "writable" if writable else "read-only"
    found: list[tuple[Path, Path]] = []
    for raw in paths:
        path = _real(raw)
        if not path.exists():
            raise SandboxRefused(f"the {kind} path {raw} does not exist")
        for h in hidden:
            if path == h or path.is_relative_to(h) or (writable and h.is_relative_to(path)):
                raise SandboxRefused(
                    f"the {kind} path {raw} would show {h}, which must stay hidden from tools "
                    "(Kazma's state directory or configuration)"
                )
        given = Path(os.path.abspath(raw))
        if (path, given) not in found:
            found.append((path, given))
    return found


# --------------------------------------------------------------------------- detection


@dataclass(frozen=True)
class BwrapProbe:
    """What detection found: the path of a bwrap that works, or why there is none."""

    path: str | None
    problem: str | None = None

    @property
    def available(self) -> bool:
        return self.path is not None and self.problem is None


def probe_bwrap(binary: str = "bwrap") -> BwrapProbe:
    """Find ``binary`` (a name looked up on PATH, or a path) and check that it can build our sandbox.

    A bwrap that exists but cannot create namespaces (a container without
    user namespaces, a kernel that forbids them) counts as unavailable. The
    trial run is cached per binary path for the life of the process.
    """
    found = shutil.which(binary)
    if found is None:
        return BwrapProbe(path=None, problem=f"{binary!r} was not found on PATH")
    return _probe(os.path.abspath(found))


@functools.cache
def _probe(path: str) -> BwrapProbe:
    # The trial uses the very flags of a real call (network off, which adds the
    # one namespace a network-on call does not need), so success means calls work.
    with tempfile.TemporaryDirectory(prefix="kazma-sandbox-probe-") as scratch:
        workspace = Path(scratch)
        env = sandbox_environment(workspace)
        argv = bwrap_argv(path, ["/bin/sh", "-c", ":"], workspace=workspace, network=False, env=env)
        try:
            done = subprocess.run(  # noqa: S603 - a fixed argv, no shell
                argv,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                env=env,
                timeout=_PROBE_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            problem: str | None = f"{path} did not finish a trial run within {_PROBE_TIMEOUT_S:g} s"
        except OSError as exc:
            problem = f"{path} could not be started: {exc}"
        else:
            if done.returncode == 0:
                problem = None
            else:
                said = done.stderr.decode("utf-8", errors="replace").strip().splitlines()
                detail = said[0] if said else f"exit code {done.returncode}"
                problem = f"{path} cannot create the sandbox here: {detail}"
    if problem is None:
        log.info("sandbox.probe_ok", bwrap=path)
        return BwrapProbe(path=path)
    log.warning("sandbox.probe_failed", bwrap=path, problem=problem)
    return BwrapProbe(path=path, problem=problem)


# --------------------------------------------------------------------------- the resolved sandbox


@dataclass(frozen=True)
class Sandbox:
    """How shell commands run on this host, decided once from the configured mode and what detection found.

    ``binary`` is set exactly when commands run inside bubblewrap;
    ``problem`` says why bubblewrap is not used when it was wanted.
    """

    mode: SandboxMode
    binary: str | None = None
    problem: str | None = None

    @property
    def active(self) -> bool:
        return self.binary is not None

    @property
    def refuses(self) -> bool:
        """``mode: bwrap`` without a working bubblewrap: every call is refused, nothing runs unsandboxed."""
        return self.mode == "bwrap" and not self.active

    def describe(self) -> str:
        """One line for approval cards and ``kazma doctor``."""
        if self.active:
            return "sandboxed (bubblewrap)"
        if self.refuses:
            return "refuses to run: sandbox is bwrap but bubblewrap is unavailable"
        return "runs unsandboxed on this host"

    @property
    def refusal(self) -> str | None:
        """Why every call is refused and how to fix it, or None when calls may run."""
        if not self.refuses:
            return None
        return (
            f"the shell tool requires the bubblewrap sandbox (sandbox: bwrap), but {self.problem}; "
            f"{INSTALL_HINT}, or set the sandbox to auto or none to run commands unsandboxed"
        )

    def environment(self, workspace: Path, source: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment to start bwrap with and to give the command (the same one: see /proc/1)."""
        return sandbox_environment(workspace, source)

    def wrap(
        self,
        command: Sequence[str],
        *,
        workspace: Path,
        network: bool,
        env: Mapping[str, str],
        hidden: Iterable[Path | str] = (),
        read_only: Iterable[Path | str] = (),
        writable: Iterable[Path | str] = (),
    ) -> list[str]:
        """The argv that runs ``command`` in this sandbox (see :func:`bwrap_argv`)."""
        if self.binary is None:
            raise RuntimeError(f"the sandbox is not active ({self.describe()})")
        return bwrap_argv(
            self.binary,
            command,
            workspace=workspace,
            network=network,
            env=env,
            hidden=hidden,
            read_only=read_only,
            writable=writable,
        )


@functools.cache
def _warn_unsandboxed(problem: str) -> None:
    # Once per process and reason: every ShellTool built on such a host would say the same.
    log.warning("sandbox.unavailable", problem=problem, fallback="unsandboxed", hint=INSTALL_HINT)


def resolve_sandbox(mode: SandboxMode = "auto", *, binary: str = "bwrap") -> Sandbox:
    """Decide how commands run: ``auto`` uses bubblewrap when it works here, ``bwrap`` insists, ``none`` never.

    ``binary`` is the bwrap to use, a name on PATH or a path.
    """
    if mode not in SANDBOX_MODES:
        raise ValueError(f"sandbox mode must be one of {', '.join(SANDBOX_MODES)}, not {mode!r}")
    if mode == "none":
        return Sandbox(mode=mode)
    probe = probe_bwrap(binary)
    if probe.available:
        return Sandbox(mode=mode, binary=probe.path)
    if mode == "auto":
        _warn_unsandboxed(probe.problem or "unknown")
    else:
        log.error("sandbox.missing", problem=probe.problem, hint=INSTALL_HINT)
    return Sandbox(mode=mode, problem=probe.problem)
