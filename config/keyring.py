"""Secret keys Kazma keeps outside its store: one keyring per purpose, from an environment variable or a file.

A keyring holds the current key, which makes new seals, and older keys, which
only verify: rotating puts a new key first and keeps the others, so what an
older key sealed stays valid until that key is retired. The keys never enter
the store (neither a copy of the store nor anything that can write it holds
one), and never reach a tool: a sandboxed command's environment is built from
an allowlist and the keys folder is hidden from it, an MCP server gets only the
variables its configuration names and may not name a key's, and ``kazma.yaml``
may not substitute a key's variable anywhere (it could end up in a prompt).

The text form is the same in the file and in the variable: ``<id>:<secret>``
entries separated by white space or new lines, the current key first; lines
starting with ``#`` are comments. Replicas on one database share a keyring by
sharing that text (the variable, or the same file on every machine).

Where a keyring comes from, in order: the purpose's environment variable when
it is set and not empty; otherwise the file ``<purpose>`` in the keys folder, a
sibling of the store's folder (``.kazma-keys/`` beside ``.kazma/``), made on
first use (folder 0700, file 0600) where the caller may create it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import re
import secrets
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger("kazma.config.keyring")

_KEY_ID = re.compile(r"[A-Za-z0-9_.-]{1,32}")
_NUMBERED = re.compile(r"k([0-9]{1,9})")
_ANOTHER_KEY = re.compile(r",[A-Za-z0-9_.-]{1,32}:")  # a comma, then what reads as the next entry's "<id>:"
# "# retired <id>": a key taken out on purpose (`kazma keys retire` writes it; a person editing the variable may).
# A comment, so every Kazma reads the text as before; what that key sealed is then history no longer checked, where
# a key named nowhere is a forgery or a replica given other keys.
_RETIRED_LINE = re.compile(r"#\s*retired\s+([A-Za-z0-9_.-]{1,32})(?:\s|$)")


class KeyringError(Exception):
    """A keyring that cannot be used, with the reason a person can act on."""


class KeyMissing(KeyringError):
    """Neither the variable nor the file holds a key (and none may be made here)."""


def _text_secret(text: str) -> bytes:
    return text.encode("utf-8")


def _new_text_secret() -> str:
    return secrets.token_urlsafe(32)  # 256 random bits, 43 characters


@dataclass(frozen=True)
class KeySpec:
    """How one purpose's keys are found, read and made.

    ``decode`` turns the written secret into key material (raising ValueError with the reason when it is not
    usable); ``generate`` writes a new one. A signing key (Ed25519) would decode a base64 seed and generate one.
    """

    purpose: str  # names the file in the keys folder, and the keyring in messages
    env: str  # the environment variable that, when set, holds the whole keyring
    header: str  # the file's first comment: what the keys are for
    min_length: int = 32
    decode: Callable[[str], bytes] = _text_secret
    generate: Callable[[], str] = _new_text_secret

    def file(self, folder: Path) -> Path:
        return folder / self.purpose


DECISION_KEYS = KeySpec(
    "decision",
    "KAZMA_DECISION_KEY",
    "Kazma's decision keys (HMAC-SHA256 seals on every approval outcome). The first key seals new decisions;\n"
    "# every key verifies. `kazma keys rotate` puts a new one first; keep an old key while decisions it sealed\n"
    "# must stay runnable. Never copy this file into the store's folder or a workspace.",
)


def _signing_seed(written: str) -> bytes:
    """An Ed25519 private key as written: its 32-byte seed in URL-safe base64 (padding optional)."""
    try:
        seed = base64.b64decode(written + "=" * (-len(written) % 4), altchars=b"-_", validate=True)
    except (ValueError, binascii.Error):
        raise ValueError("not URL-safe base64") from None
    if len(seed) != 32:
        raise ValueError(f"an Ed25519 seed is 32 bytes, this one is {len(seed)}")
    return seed


def _new_signing_seed() -> str:
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode("ascii").rstrip("=")


AUDIT_KEYS = KeySpec(
    "audit",
    "KAZMA_AUDIT_KEY",
    "Kazma's audit keys (Ed25519: each one signs checkpoints of the audit chain). The first key signs new\n"
    "# checkpoints; every key's public half verifies. `kazma keys rotate --audit` puts a new one first; keep the\n"
    "# older ones: checkpoints they signed verify with them. Never copy this file into the store's folder.",
    min_length=43,
    decode=_signing_seed,
    generate=_new_signing_seed,
)

# Every variable that holds a keyring: kazma.yaml may not substitute one, and no MCP server may be given one.
KEY_VARIABLES = frozenset({DECISION_KEYS.env, AUDIT_KEYS.env})


def keys_folder(store_path: Path) -> Path:
    """Where key files live: a sibling of the store's folder (``.kazma-keys`` beside ``.kazma``), so that the
    store's folder (and any copy or backup of it) never holds a key."""
    state = store_path.parent
    return state.parent / f"{state.name or 'kazma'}-keys"


@dataclass(frozen=True)
class Key:
    id: str
    secret: bytes = field(repr=False)  # the key material
    written: str = field(repr=False, default="")  # as written in the file or the variable (for log redaction)


def parse_keys(text: str, spec: KeySpec, *, source: str) -> tuple[Key, ...]:
    """The keys written in ``text`` (current first); KeyringError naming ``source`` when any is unusable."""
    keys: list[Key] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("#"):
            continue
        for entry in line.split():
            key_id, colon, written = entry.partition(":")
            where = f"{source} (line {number})" if "\n" in text.strip() else source
            if not colon:
                raise KeyringError(f"{where}: expected <id>:<secret> entries, got one without ':'")
            if not _KEY_ID.fullmatch(key_id):
                raise KeyringError(f"{where}: a key id is 1 to 32 of A-Z a-z 0-9 _ . -, got {key_id[:40]!r}")
            if written.endswith(",") or _ANOTHER_KEY.search(written):
                # "k1:…,k2:…" was read as one key k1 whose secret ran on past the comma: a keyring other replicas
                # (or this one, once written right) do not share, so their seals failed to verify, without a word
                raise KeyringError(
                    f"{where}: key {key_id} runs on past a comma; separate keys with spaces or new lines, not commas"
                )
            if len(written) < spec.min_length:
                raise KeyringError(
                    f"{where}: key {key_id} is {len(written)} characters; at least {spec.min_length} are required"
                )
            try:
                secret = spec.decode(written)
            except ValueError as exc:
                raise KeyringError(f"{where}: key {key_id} is not usable: {exc}") from None
            if any(k.id == key_id for k in keys):
                raise KeyringError(f"{where}: key id {key_id} appears twice")
            keys.append(Key(key_id, secret, written))
    if not keys:
        raise KeyMissing(f"{source} holds no key")
    return tuple(keys)


def retired_ids(text: str) -> tuple[str, ...]:
    """The ids ``text`` records as retired (``# retired <id>`` lines), in order, each once."""
    found: list[str] = []
    for line in text.splitlines():
        match = _RETIRED_LINE.match(line.strip())
        if match and match.group(1) not in found:
            found.append(match.group(1))
    return tuple(found)


def format_keys(keys: tuple[tuple[str, str], ...], spec: KeySpec, retired: tuple[str, ...] = ()) -> str:
    """The file text of ``(id, written secret)`` pairs, current first, and the ids retired from it."""
    lines = [f"# {spec.header}"] + [f"{key_id}:{written}" for key_id, written in keys]
    lines += [
        f"# retired {key_id} (kazma keys retire): what it sealed is history, no longer checked" for key_id in retired
    ]
    return "\n".join(lines) + "\n"


class Keyring:
    """The keys of one purpose as this process holds them: the current one seals, each one verifies.

    A seal made by another process with a key this one has not read yet (the file was rotated while it ran) is
    found by reading the file again on that miss, when the file changed since it was last read: a seal naming a
    key that is nowhere (forged, or retired) costs a ``stat``, not a read of the file, however often it is met.
    """

    def __init__(
        self,
        spec: KeySpec,
        keys: tuple[Key, ...],
        *,
        source: str,
        path: Path | None = None,
        generated: bool = False,
        retired: tuple[str, ...] = (),
    ) -> None:
        if not keys:
            raise KeyMissing(f"{source} holds no key")
        self.spec = spec
        self._keys = keys
        # Ids taken out on purpose (see retired_ids): what they sealed verifies no more, and is not a forgery.
        self.retired = retired
        self.source = source  # "$KAZMA_DECISION_KEY", or the file's path
        self.path = path  # the file read, or None (the variable, or keys given in code)
        self.generated = generated  # made by this call (first start)
        # The file as it was when last read again (None: not yet; the first miss reads it): a miss reads it only
        # when this changed. Every forged seal naming a made-up key read and parsed the whole file again.
        self._read_as: tuple[int, int, int, int] | None = None

    @classmethod
    def of(cls, spec: KeySpec, *pairs: tuple[str, str]) -> Keyring:
        """A keyring of literal ``(id, written secret)`` pairs, current first (tests, benchmarks)."""
        text = " ".join(f"{key_id}:{written}" for key_id, written in pairs)
        return cls(spec, parse_keys(text, spec, source="keys given in code"), source="keys given in code")

    @property
    def current(self) -> Key:
        return self._keys[0]

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(k.id for k in self._keys)

    def written(self) -> tuple[str, ...]:
        """Every key as written, for log redaction only."""
        return tuple(k.written for k in self._keys)

    def find(self, key_id: str) -> Key | None:
        """The key named ``key_id``, reading the file again once when it is not held (None: nowhere)."""
        for key in self._keys:
            if key.id == key_id:
                return key
        if self.path is None:
            return None
        try:
            # Taken before the read: a file replaced between the two is read once more at the next miss, never
            # taken for read when it was not.
            seen = _identity(self.path)
        except OSError as exc:
            log.warning("keyring.reread_failed", purpose=self.spec.purpose, path=str(self.path), error=str(exc))
            return None
        if seen == self._read_as:
            # Nothing changed since it was last read. The keys are looked up again: another thread (the writer's,
            # the loop) may have read it since this one looked, and it sets what it read before its identity.
            return next((k for k in self._keys if k.id == key_id), None)
        try:
            text = self.path.read_text(encoding="utf-8")
            keys = parse_keys(text, self.spec, source=str(self.path))
        except (OSError, UnicodeDecodeError, KeyringError) as exc:
            log.warning("keyring.reread_failed", purpose=self.spec.purpose, path=str(self.path), error=str(exc))
            self._read_as = seen  # unusable as it is: read again once it changed
            return None
        self._keys = keys
        self.retired = retired_ids(text)
        self._read_as = seen  # after the keys: whoever finds it unchanged finds them
        log.info("keyring.reread", purpose=self.spec.purpose, path=str(self.path), keys=list(self.ids), wanted=key_id)
        return next((k for k in keys if k.id == key_id), None)

    def describe(self) -> str:
        """One line for people: where the keys are and which ids, never a secret."""
        older = f"; older, verifying only: {', '.join(self.ids[1:])}" if len(self._keys) > 1 else ""
        gone = [i for i in self.retired if i not in self.ids]
        retired = f"; retired (what they sealed is history, not checked): {', '.join(gone)}" if gone else ""
        return f"{self.source}: current key {self.current.id}{older}{retired}"


def _identity(path: Path) -> tuple[int, int, int, int]:
    """What changes whenever the file is rewritten: rotating and retiring replace it (a new inode), an editor
    rewrites it (a new modification time or size)."""
    st = path.stat()
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


def read_keyring(spec: KeySpec, folder: Path, environ: Mapping[str, str] | None = None) -> Keyring:
    """The keyring from ``spec.env`` when set, else from its file in ``folder``; never makes one.

    Raises :class:`KeyMissing` when neither holds a key, :class:`KeyringError` when what is there is unusable.
    """
    environ = os.environ if environ is None else environ
    written = environ.get(spec.env, "")
    if written.strip():
        source = f"${spec.env}"
        return Keyring(spec, parse_keys(written, spec, source=source), source=source, retired=retired_ids(written))
    path = spec.file(folder)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KeyMissing(f"no {spec.purpose} key: {spec.env} is not set and {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyringError(f"{path} cannot be read: {exc}") from None
    return Keyring(
        spec, parse_keys(text, spec, source=str(path)), source=str(path), path=path, retired=retired_ids(text)
    )


def open_keyring(
    spec: KeySpec, folder: Path, environ: Mapping[str, str] | None = None, *, create: bool = True
) -> Keyring:
    """:func:`read_keyring`, making the file with one new key when there is none and ``create`` allows it.

    A file others may read is tightened to 0600 (and said), as the console's token files are.
    """
    try:
        ring = read_keyring(spec, folder, environ)
    except KeyMissing:
        if not create:
            raise
        return _create(spec, folder)
    if ring.path is not None:
        _tighten(ring.path)
    return ring


def loose_mode(path: Path) -> str | None:
    """Why ``path``'s permissions let someone else than its owner read it, or None."""
    mode = stat.S_IMODE(path.stat().st_mode)
    return f"mode {mode:04o} lets others read it (want 0600)" if mode & 0o077 else None


def _tighten(path: Path) -> None:
    with contextlib.suppress(OSError):
        if loose_mode(path) is not None and path.stat().st_uid == os.getuid():
            log.warning("keyring.permissions_tightened", path=str(path))
            path.chmod(0o600)


def _private_folder(folder: Path) -> None:
    if not folder.exists():
        folder.mkdir(parents=True, mode=0o700, exist_ok=True)
    elif folder.stat().st_uid == os.getuid() and folder.stat().st_mode & 0o077:
        os.chmod(folder, 0o700)


def _write_new(path: Path, text: str) -> None:
    """``text`` at ``path`` whole or not at all, never readable by others, never over an existing file."""
    scratch = path.with_name(f".{path.name}.{secrets.token_hex(6)}.new")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.link(scratch, path)  # fails if another process made the file first: theirs stands
    finally:
        scratch.unlink(missing_ok=True)


def _replace(path: Path, text: str) -> None:
    """``text`` over ``path`` in one rename: a reader sees the old keys or the new ones, never half."""
    scratch = path.with_name(f".{path.name}.{secrets.token_hex(6)}.new")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(scratch, path)
    finally:
        scratch.unlink(missing_ok=True)


def _create(spec: KeySpec, folder: Path) -> Keyring:
    _private_folder(folder)
    path = spec.file(folder)
    try:
        _write_new(path, format_keys((("k1", spec.generate()),), spec))
    except FileExistsError:  # another process (a CLI command, a second start) made it a moment ago
        return read_keyring(spec, folder, environ={})
    log.info("keyring.created", purpose=spec.purpose, path=str(path))
    keys = parse_keys(path.read_text(encoding="utf-8"), spec, source=str(path))
    return Keyring(spec, keys, source=str(path), path=path, generated=True)


def _written_entries(path: Path, spec: KeySpec) -> tuple[tuple[str, str], ...]:
    """The file's ``(id, written secret)`` pairs (checked by :func:`parse_keys` first)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as exc:  # `kazma keys rotate` ended in a traceback: say it as keys list does
        raise KeyringError(f"{path} cannot be read: {exc}") from None
    parse_keys(text, spec, source=str(path))
    pairs = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for entry in line.split():
            key_id, _, written = entry.partition(":")
            pairs.append((key_id, written))
    return tuple(pairs)


def _retired_in(path: Path) -> tuple[str, ...]:
    """The ids ``path`` records as retired (read after :func:`_written_entries` read it)."""
    return retired_ids(path.read_text(encoding="utf-8"))


def _file_only(spec: KeySpec, environ: Mapping[str, str] | None) -> None:
    environ = os.environ if environ is None else environ
    if environ.get(spec.env, "").strip():
        raise KeyringError(
            f"the {spec.purpose} keys come from {spec.env} here: change that variable (a new <id>:<secret> first, "
            "the old ones after it) on every process that shares it"
        )


def next_key_id(ids: tuple[str, ...]) -> str:
    """``k<n+1>`` after the highest ``k<n>`` among ``ids`` (``k1`` when there is none)."""
    numbers = [int(m.group(1)) for m in (_NUMBERED.fullmatch(i) for i in ids) if m]
    return f"k{max(numbers, default=0) + 1}"


def rotate_key_file(spec: KeySpec, folder: Path, environ: Mapping[str, str] | None = None) -> Keyring:
    """A new current key first in the file, every older key kept (they still verify what they sealed)."""
    _file_only(spec, environ)
    path = spec.file(folder)
    if not path.exists():
        return _create(spec, folder)
    pairs = _written_entries(path, spec)
    retired = _retired_in(path)
    # Never an id once retired: its old seals would read as forged under the new key, not as history.
    new = (next_key_id(tuple(p[0] for p in pairs) + retired), spec.generate())
    _replace(path, format_keys((new, *pairs), spec, retired))
    log.info("keyring.rotated", purpose=spec.purpose, path=str(path), current=new[0])
    return read_keyring(spec, folder, environ={})


def retire_key(spec: KeySpec, folder: Path, key_id: str, environ: Mapping[str, str] | None = None) -> Keyring:
    """Remove an older key: what it sealed no longer verifies (approved calls it sealed will not run)."""
    _file_only(spec, environ)
    path = spec.file(folder)
    try:
        pairs = _written_entries(path, spec)
    except FileNotFoundError:
        raise KeyMissing(f"{path} does not exist") from None
    if key_id not in [p[0] for p in pairs]:
        raise KeyringError(f"{path} holds no key {key_id!r} (keys: {', '.join(p[0] for p in pairs)})")
    if pairs[0][0] == key_id:
        raise KeyringError(f"{key_id} is the current key: rotate first (`kazma keys rotate`), then retire it")
    # Recorded as retired: what it sealed is then history to `kazma audit verify`, not a seal it cannot place.
    retired = (*(i for i in _retired_in(path) if i != key_id), key_id)
    _replace(path, format_keys(tuple(p for p in pairs if p[0] != key_id), spec, retired))
    log.info("keyring.retired", purpose=spec.purpose, path=str(path), key=key_id)
    return read_keyring(spec, folder, environ={})
