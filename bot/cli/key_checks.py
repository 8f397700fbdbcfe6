"""What ``kazma doctor`` asks of every key file Kazma holds (the decision key, the audit key): private, and
apart from the store's folder and the workspaces, so neither a copy of the store nor a tool carries it away."""

from __future__ import annotations

import os
from pathlib import Path

from kazma.config.keyring import KeyMissing, Keyring, loose_mode
from kazma.config.models import KazmaConfig


def key_file_problem(ring: Keyring, config: KazmaConfig, *, power: str) -> str | None:
    """Why ``ring``'s file is not kept the way a key must be, or None (it is, or the key is in the environment).
    ``power``: what whoever reads it could do, e.g. "can seal approvals"."""
    if ring.path is None:
        return None
    try:
        loose = loose_mode(ring.path)
    except OSError as exc:
        return f"{ring.path} cannot be examined: {exc}"
    if loose is not None:
        return f"{ring.path}: {loose}: whoever reads it {power} (chmod 600)"
    for folder, what in (
        (config.store.path.parent, "the store's folder (a copy or backup of it would carry the key)"),
        (config.tools.workspaces(config.store.path), "the workspaces' folder (tools work there)"),
    ):
        if _inside(ring.path, folder):
            return f"{ring.path} is inside {what}: keep it apart from {folder}"
    return None


def replicas_need_it(exc: KeyMissing, env: str) -> str:
    """A missing key on PostgreSQL: every replica must hold the same one."""
    return (
        f"{exc}: with PostgreSQL every replica needs the same {env} (kazma run refuses to start without one), "
        "or the same key file on each"
    )


def _inside(path: Path, folder: Path) -> bool:
    real, around = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return real == around or real.is_relative_to(around)
