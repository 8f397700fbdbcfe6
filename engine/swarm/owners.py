"""Which process runs a swarm task that a terminal started (``kazma swarm …`` runs its work in its own process).

Such a task's row names its process: this host, this boot, its pid and the moment that pid started (so a pid the
kernel handed out again is not taken for it). ``kazma run`` starting, or a leader recovering what dead replicas
left, leaves a task alone while the terminal running it is alive; a terminal on another host cannot be asked, so
its tasks are left to it (it ends them at its exit; one that died is ended with ``/swarm cancel``).
"""

from __future__ import annotations

import os
import socket
from functools import cache
from pathlib import Path
from typing import Final

PREFIX: Final = "terminal/"


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


def held_by_a_terminal(owner: str | None) -> bool:
    """Whether ``owner`` is a terminal that is alive here, or on another host (which nobody here can ask)."""
    if owner is None or not owner.startswith(PREFIX):
        return False
    try:
        host, boot, pid, started = owner[len(PREFIX) :].split("/")
    except ValueError:
        return False
    if host != socket.gethostname():
        return True
    return boot == _boot_id() and pid.isdigit() and _started(int(pid)) == started
