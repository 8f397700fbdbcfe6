"""Which process runs a swarm task that a terminal started (``kazma swarm …`` runs its work in its own process).

Such a task's row names its process: this host, this boot, its pid and the moment that pid started (so a pid the
kernel handed out again is not taken for it). ``kazma run`` starting, or a leader recovering what dead replicas
left, leaves a task alone while the terminal running it is alive; a terminal on another host (or in another
container) cannot be asked, so it touches its running tasks' rows every second, and is taken for gone when it
has not for :data:`SILENT_SECONDS`.
"""

from __future__ import annotations

import os
import socket
from functools import cache
from pathlib import Path
from typing import Final

PREFIX: Final = "terminal/"
# A terminal elsewhere whose tasks' rows were not touched for this long is gone (they are ended as interrupted).
SILENT_SECONDS: Final = 120.0


@cache
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        return "unknown"


def _started(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot: field 22 of /proc/<pid>/stat), or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()[19]  # fields after the command name, which may hold spaces


def this_terminal() -> str:
    """The owner a terminal's tasks carry: ``terminal/<host>/<boot>/<pid>/<started>`` (no name holds a slash)."""
    pid = os.getpid()
    return "/".join((PREFIX.rstrip("/"), socket.gethostname(), _boot_id(), str(pid), _started(pid) or "?"))


def held_by_a_terminal(owner: str | None, updated_at: float, now: float) -> bool:
    """Whether ``owner`` is a terminal that is alive: here, its process is; on another host (or in another
    container), its task's row was touched within :data:`SILENT_SECONDS` (a terminal touches its running tasks'
    rows every second)."""
    if owner is None or not owner.startswith(PREFIX):
        return False
    try:
        host, boot, pid, started = owner[len(PREFIX) :].split("/")
    except ValueError:
        return False
    if host != socket.gethostname() or boot != _boot_id():
        return now - updated_at < SILENT_SECONDS
    return pid.isdigit() and _started(int(pid)) == started


def is_terminal(owner: str | None) -> bool:
    return owner is not None and owner.startswith(PREFIX)
