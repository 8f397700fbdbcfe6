"""The decision keyring of a configured Kazma: where it is, loading it for ``kazma run`` and the CLI.

On SQLite the key file is made at first use (``.kazma-keys/decision`` beside the store's folder, 0600). On
PostgreSQL nothing is made: every replica must verify the others' seals, so they share one keyring by
``KAZMA_DECISION_KEY`` (or the same key file put on every machine), and a replica without one does not start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from kazma.bot.logging import redact_secret
from kazma.config.errors import ConfigError, Problem
from kazma.config.keyring import DECISION_KEYS, KeyMissing, Keyring, KeyringError, keys_folder, open_keyring
from kazma.config.models import KazmaConfig

_IN_MEMORY = ":memory:"


def decision_keys_folder(config: KazmaConfig) -> Path:
    return keys_folder(config.store.path)


def decision_key_file(config: KazmaConfig) -> Path:
    return DECISION_KEYS.file(decision_keys_folder(config))


def load_decision_keyring(config: KazmaConfig, environ: Mapping[str, str] | None = None) -> Keyring:
    """The keyring that seals and verifies decisions on this store; made on SQLite when there is none.

    Raises ConfigError (one line, what to do) when it is missing on PostgreSQL or unusable anywhere.
    """
    environ = os.environ if environ is None else environ
    shared = config.store.backend == "postgresql"
    if not shared and str(config.store.path) == _IN_MEMORY and not environ.get(DECISION_KEYS.env, "").strip():
        # A store that dies with the process: a key that does too.
        return Keyring.of(DECISION_KEYS, ("k1", DECISION_KEYS.generate()))
    try:
        ring = open_keyring(DECISION_KEYS, decision_keys_folder(config), environ, create=not shared)
    except KeyMissing:
        raise ConfigError(
            DECISION_KEYS.env,
            [
                Problem(
                    "",
                    "with a PostgreSQL store every replica must verify the decisions the others seal: set "
                    f"{DECISION_KEYS.env} to the same value on every replica (e.g. k1:$(openssl rand -hex 32)), or "
                    f"put the same key file at {decision_key_file(config)} on each",
                )
            ],
        ) from None
    except KeyringError as exc:
        raise ConfigError(DECISION_KEYS.env, [Problem("", f"the decision key cannot be used: {exc}")]) from None
    for written in ring.written():
        redact_secret(written)  # a key never reaches a log line
    return ring


def read_decision_keyring(config: KazmaConfig, environ: Mapping[str, str] | None = None) -> Keyring | None:
    """The keyring if there is a usable one, never making one (commands that only read): None otherwise."""
    try:
        return open_keyring(DECISION_KEYS, decision_keys_folder(config), environ, create=False)
    except KeyringError:
        return None
