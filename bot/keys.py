"""The keyrings of a configured Kazma (decision seals, audit signatures): where they are, loading them for
``kazma run`` and the CLI.

On SQLite a key file is made at first use (``.kazma-keys/decision`` and ``.kazma-keys/audit`` beside the
store's folder, 0600). On PostgreSQL nothing is made: every replica must verify the others' seals and sign the
same chain, so they share each keyring by its variable (``KAZMA_DECISION_KEY``, ``KAZMA_AUDIT_KEY``) or the
same key file put on every machine, and a replica without one does not start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from kazma.approvals.checkpoints import AuditSigner
from kazma.bot.logging import redact_secret
from kazma.config.errors import ConfigError, Problem
from kazma.config.keyring import (
    AUDIT_KEYS,
    DECISION_KEYS,
    KeyMissing,
    Keyring,
    KeyringError,
    KeySpec,
    keys_folder,
    open_keyring,
)
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
    return _load(
        DECISION_KEYS,
        config,
        environ,
        why="verify the decisions the others seal",
        example="k1:$(openssl rand -hex 32)",
        what="the decision key",
    )


def read_decision_keyring(config: KazmaConfig, environ: Mapping[str, str] | None = None) -> Keyring | None:
    """The keyring if there is a usable one, never making one (commands that only read): None otherwise."""
    try:
        return open_keyring(DECISION_KEYS, decision_keys_folder(config), environ, create=False)
    except KeyringError:
        return None


def audit_key_file(config: KazmaConfig) -> Path:
    return AUDIT_KEYS.file(decision_keys_folder(config))


def load_audit_signer(config: KazmaConfig, environ: Mapping[str, str] | None = None) -> AuditSigner:
    """What signs the audit chain's checkpoints on this store (Ed25519); its key is made on SQLite when there is
    none. Raises ConfigError (one line, what to do) when it is missing on PostgreSQL or unusable anywhere."""
    ring = _load(
        AUDIT_KEYS,
        config,
        environ,
        why="sign the one audit chain they share",
        example="a1:$(openssl rand 32 | basenc --base64url)",
        what="the audit key",
    )
    return AuditSigner(ring)


def read_audit_signer(config: KazmaConfig, environ: Mapping[str, str] | None = None) -> AuditSigner | None:
    """The audit signer if there is a usable key, never making one (commands that only read): None otherwise."""
    try:
        return AuditSigner(open_keyring(AUDIT_KEYS, decision_keys_folder(config), environ, create=False))
    except KeyringError:
        return None


def audit_key_problem(config: KazmaConfig, environ: Mapping[str, str] | None = None) -> str:
    """Why :func:`read_audit_signer` found no usable key, as a person can act on it: none there, or the one there
    (``$KAZMA_AUDIT_KEY`` or the file) and what is wrong with it. Said "no usable key" alone, a variable with a
    typo in it read as one never set."""
    where = f"{audit_key_file(config)} or in ${AUDIT_KEYS.env}"
    try:
        open_keyring(AUDIT_KEYS, decision_keys_folder(config), environ, create=False)
    except KeyMissing:
        return f"no audit key at {where}; kazma run makes one at its first start"
    except KeyringError as exc:
        return f"the audit key cannot be used: {exc}"
    return f"no usable audit key at {where}"


def _load(
    spec: KeySpec, config: KazmaConfig, environ: Mapping[str, str] | None, *, why: str, example: str, what: str
) -> Keyring:
    environ = os.environ if environ is None else environ
    shared = config.store.backend == "postgresql"
    if not shared and str(config.store.path) == _IN_MEMORY and not environ.get(spec.env, "").strip():
        # A store that dies with the process: a key that does too.
        return Keyring.of(spec, ("k1", spec.generate()))
    try:
        ring = open_keyring(spec, decision_keys_folder(config), environ, create=not shared)
    except KeyMissing:
        raise ConfigError(
            spec.env,
            [
                Problem(
                    "",
                    f"with a PostgreSQL store every replica must {why}: set {spec.env} to the same value on every "
                    f"replica (e.g. {example}), or put the same key file at "
                    f"{spec.file(decision_keys_folder(config))} on each",
                )
            ],
        ) from None
    except KeyringError as exc:
        raise ConfigError(spec.env, [Problem("", f"{what} cannot be used: {exc}")]) from None
    for written in ring.written():
        redact_secret(written)  # a key never reaches a log line
    return ring
