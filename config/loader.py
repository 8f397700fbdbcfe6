"""Read ``kazma.yaml``: parse, substitute the environment, validate, explain."""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from kazma.config.env import format_path, substitute
from kazma.config.errors import ConfigError, Problem
from kazma.config.keyring import KEY_VARIABLES
from kazma.config.models import KazmaConfig
from kazma.config.registry import CHAT_PLATFORMS

log = structlog.get_logger("kazma.config.loader")
DEFAULT_PATH = Path("kazma.yaml")
CONFIG_ENV = "KAZMA_CONFIG"
# The folder relative paths in kazma.yaml are resolved against, when it is not the file's own folder: a
# configuration on a read-only /etc/kazma with its state in /var/lib/kazma (the Docker image, the systemd unit).
BASE_DIR_ENV = "KAZMA_BASE_DIR"


@dataclass(frozen=True)
class LoadedConfig:
    """A validated configuration and where it came from."""

    config: KazmaConfig
    source: Path | None
    # key path -> environment variables it referenced, to explain why a platform is off
    references: dict[str, list[str]] = field(default_factory=dict)
    # (key path, variable) of platform secrets that were not set; loaded without them, those platforms are off.
    # Empty unless loaded with ``platform_secrets=False`` (a command that never talks to a platform).
    unset_secrets: list[tuple[str, str]] = field(default_factory=list)

    @property
    def platforms_without_secrets(self) -> list[str]:
        """The platforms turned off here because a secret they read is not set."""
        return list(dict.fromkeys(where.split(".")[1] for where, _ in self.unset_secrets))


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of keeping the last silently."""


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    # `<<: *defaults` (a worker's shared settings) was "could not determine a constructor for the tag
    # 'tag:yaml.org,2002:merge'": merges are flattened as SafeLoader does, the merged pairs first. A key of the
    # mapping's own overrides a merged one, as YAML says; written twice by hand it is still refused.
    own_count = sum(1 for key_node, _ in node.value if key_node.tag != _MERGE_TAG)
    loader.flatten_mapping(node)
    merged_count = len(node.value) - own_count
    seen: dict[Any, Any] = {}
    own: set[Any] = set()
    for index, (key_node, value_node) in enumerate(node.value):
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, list | dict | set):  # "? [a]", "? !!set {a}": YAML allows them, no setting is named so
            # (and they are unhashable)
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(None, None, f"a key must be a name, got {_kind(key)}", mark)
        if index < merged_count:
            if key not in seen:  # `<<: [*a, *b]`: the earlier mapping's key wins, as the merge spec says
                seen[key] = loader.construct_object(value_node, deep=deep)
            continue
        if key in own:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", mark)
        own.add(key)
        seen[key] = loader.construct_object(value_node, deep=deep)
    return seen


def _construct_int(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> int:
    try:
        return int(yaml.constructor.SafeConstructor.construct_yaml_int(loader, node))
    except ValueError:  # Python refuses to read more than 4300 digits: no setting holds such a number
        raise yaml.constructor.ConstructorError(
            None, None, f"a number of {len(str(node.value))} characters is too long", node.start_mark
        ) from None


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)

# What a kazma.yaml may grow to once its aliases are expanded, and how deep it may nest. Every pass over the
# settings (substitution, validation) walks the expanded tree: nine aliases of nine aliases of ... ("billion
# laughs") is a few lines that took minutes and all the memory, and a list nested a thousand deep, or one that
# holds itself (`a: &a [*a]`), ended in a RecursionError traceback.
MAX_VALUES = 100_000
MAX_DEPTH = 64


def _parse(text: str) -> Any:
    """The YAML document in ``text``, refused before it is built when it would be too large or too deep."""
    loader = _UniqueKeyLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:  # PyYAML's composer recurses once per level: it gave up long before MAX_DEPTH did
            raise yaml.constructor.ConstructorError(
                None, None, f"nested more than {MAX_DEPTH} levels deep", loader.get_mark()
            ) from None
        if node is None:
            return None
        _check_size(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_size(root: yaml.Node) -> None:
    """Refuse a document whose expanded tree holds more than :data:`MAX_VALUES` values, nests deeper than
    :data:`MAX_DEPTH`, or contains itself; the sizes of shared (aliased) nodes are counted once each and reused."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise yaml.constructor.ConstructorError(
                None, None, f"nested more than {MAX_DEPTH} levels deep", node.start_mark
            )
        known = sizes.get(id(node))
        if known is not None:
            return known
        if id(node) in open_nodes:
            raise yaml.constructor.ConstructorError(
                None, None, "an alias refers to a value that holds it", node.start_mark
            )
        open_nodes.add(id(node))
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(item, depth + 1) for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(key, depth + 1) + size(value, depth + 1) for key, value in node.value)
        open_nodes.discard(id(node))
        if total > MAX_VALUES:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"holds more than {MAX_VALUES} values once its aliases are expanded",
                node.start_mark,
            )
        sizes[id(node)] = total
        return total

    size(root, 0)


def resolve_path(path: str | Path | None) -> Path:
    if path is not None:
        return Path(path)
    # An empty KAZMA_CONFIG (compose's `${KAZMA_CONFIG:-}`) is unset, as click reads it for --config: it named "."
    return Path(os.environ.get(CONFIG_ENV) or DEFAULT_PATH)


def load_config(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    platform_secrets: bool = True,
) -> LoadedConfig:
    """Load and validate a configuration file; raise :class:`ConfigError` on any problem.

    Relative paths in it (``store.path``, ``tools.workspace_root``, ``audit.sink.file``) are resolved against the
    file's folder (or ``$KAZMA_BASE_DIR``), never against the folder the command runs in: the same file names the
    same store from anywhere. ``platform_secrets=False`` is for commands that never talk to a platform: a platform
    whose secret is not set is then off instead of an error (listed in :attr:`LoadedConfig.unset_secrets`).
    """
    source = resolve_path(path)
    name = str(source)
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(name, [Problem("", "file not found (`kazma init` writes one)")]) from None
    except IsADirectoryError:
        raise ConfigError(name, [Problem("", "is a directory, expected a YAML file")]) from None
    except PermissionError:
        raise ConfigError(name, [Problem("", "cannot be read: permission denied")]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(name, [Problem("", f"is not UTF-8 text ({exc.reason} at byte {exc.start})")]) from None
    env = os.environ if environ is None else environ
    base = Path(os.path.abspath(env.get(BASE_DIR_ENV) or source.parent))  # normalised, symlinks kept
    return load_config_text(
        text, name=name, environ=environ, source=source, base_dir=base, platform_secrets=platform_secrets
    )


def load_config_text(
    text: str,
    *,
    name: str = "kazma.yaml",
    environ: Mapping[str, str] | None = None,
    source: Path | None = None,
    base_dir: Path | None = None,
    platform_secrets: bool = True,
) -> LoadedConfig:
    try:
        raw = _parse(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = exc.problem or exc.context or "unreadable"
        raise ConfigError(name, [Problem("", f"{where}invalid YAML: {problem}")]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(name, [Problem("", f"invalid YAML: {exc}")]) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(name, [Problem("", f"expected a mapping of settings at the top, got {_kind(raw)}")])

    subst = substitute(raw, os.environ if environ is None else environ)
    keys = [(where, var) for where, names in subst.references.items() for var in names if var in KEY_VARIABLES]
    if keys:
        # Whatever a setting holds may reach a model's prompt, a server or a log: a key only ever seals.
        raise ConfigError(
            name,
            [Problem(where, f"${{{var}}} holds Kazma's own keys and may not be used in {name}") for where, var in keys],
        )
    unset: list[tuple[str, str]] = []
    if subst.missing and not platform_secrets:
        unset = [(where, var) for where, var in subst.missing if where.startswith("platforms.")]
        if unset:
            _turn_off(subst.tree, unset)
            subst.missing = [missing for missing in subst.missing if missing not in unset]
    for where, var in subst.trimmed:  # the key and the variable, never the value: it is most likely a secret
        log.warning("config.env_value_trimmed", key=where, variable=var)
    if subst.missing:
        problems = [
            Problem(where, f"environment variable {var} is not set (write ${{{var}:-}} to make it optional)")
            for where, var in subst.missing
        ]
        raise ConfigError(name, problems)
    nul = list(_with_nul(subst.tree, ()))
    if nul:
        # No setting means a NUL (a path with one cannot be opened; a token or a header with one is a forgery's
        # tool): said where it is, not "embedded null byte" from deep inside a validator.
        raise ConfigError(name, [Problem(format_path(where), "may not contain a NUL character (\\0)") for where in nul])
    try:
        config = KazmaConfig.model_validate(subst.tree)
    except ValidationError as exc:
        raise ConfigError(name, [_problem(err) for err in exc.errors()]) from None
    config._source = name  # copies made from it below keep it
    if base_dir is not None:
        config = _resolved(config, base_dir)
    return LoadedConfig(config=config, source=source, references=subst.references, unset_secrets=unset)


def _with_nul(node: Any, where: tuple[str | int, ...]) -> typing.Iterator[tuple[str | int, ...]]:
    """Where a key or a text value under ``node`` holds a NUL character."""
    if isinstance(node, str):
        if "\0" in node:
            yield where
    elif isinstance(node, dict):
        for key, value in node.items():
            here = (*where, str(key))
            if isinstance(key, str) and "\0" in key:
                yield here
            yield from _with_nul(value, here)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _with_nul(value, (*where, index))


def _turn_off(tree: dict[str, Any], unset: list[tuple[str, str]]) -> None:
    """A platform missing a secret is off: its token is emptied (what "off" means in every platform's section),
    and so is every value that read a missing variable (a sign-in without its client id is off too)."""
    platforms = tree.get("platforms")
    if not isinstance(platforms, dict):
        return
    for where, _ in unset:
        parts = where.split(".")[1:]
        section = platforms.get(parts[0]) if parts else None
        if not isinstance(section, dict):
            continue
        spec = CHAT_PLATFORMS.get(parts[0])
        if spec is not None:
            section[spec.token_key] = ""
        node: Any = section
        for part in parts[1:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node[parts[-1]] = ""
            if "client_id" in node and parts[-2:-1] == ["sign_in"]:
                node["client_id"] = ""


def _resolved(config: KazmaConfig, base: Path) -> KazmaConfig:
    """``config`` with its relative paths made absolute against ``base``."""
    store = config.store
    if store.backend == "sqlite" and not store.path.is_absolute():
        store = store.model_copy(update={"path": base / store.path})
    tools = config.tools
    if tools.workspace_root is not None and not tools.workspace_root.is_absolute():
        tools = tools.model_copy(update={"workspace_root": base / tools.workspace_root})
    audit = config.audit
    sink = audit.sink
    if sink is not None and sink.file is not None and not sink.file.is_absolute():
        audit = audit.model_copy(update={"sink": sink.model_copy(update={"file": base / sink.file})})
    if store is config.store and tools is config.tools and audit is config.audit:
        return config
    return config.model_copy(update={"store": store, "tools": tools, "audit": audit})


def _kind(value: Any) -> str:
    if value is None:
        # `web:` with nothing under it (its keys commented out, or not yet written): YAML reads that as null,
        # which "NoneType None" named in Python's words
        return "nothing (the key has no value: give it one, or remove the key)"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, set):
        return "a set"
    if isinstance(value, str):
        return f"the text {_show(value)}"
    return f"{type(value).__name__} {_show(value)}"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_PLAIN = {
    "missing": "required key is missing",
    "int_parsing": "expected an integer",
    "int_type": "expected an integer",
    "int_from_float": "expected an integer",
    "float_parsing": "expected a number",
    "float_type": "expected a number",
    "bool_parsing": "expected true or false",
    "bool_type": "expected true or false",
    "string_type": "expected text",
    "list_type": "expected a list",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "finite_number": "expected a finite number",
}

_BOUNDS = {
    "greater_than": ("must be greater than", "gt"),
    "greater_than_equal": ("must be at least", "ge"),
    "less_than": ("must be less than", "lt"),
    "less_than_equal": ("must be at most", "le"),
    "string_too_short": ("must have at least {} characters", "min_length"),
    "string_too_long": ("must have at most {} characters", "max_length"),
}


def _problem(err: ErrorDetails) -> Problem:
    loc = tuple(err.get("loc", ()))
    ctx = dict(err.get("ctx") or {})
    subpath = ctx.pop("subpath", None)
    parts: tuple[str | int, ...] = tuple(p if isinstance(p, int) else str(p) for p in loc)
    # pydantic puts custom errors raised inside an ``Annotated`` validator under
    # a synthetic segment naming the function; it means nothing to a person.
    parts = tuple(p for p in parts if not (isinstance(p, str) and p.startswith("function-")))
    path = format_path(parts)
    if subpath:
        path = f"{path}.{subpath}" if path else str(subpath)
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        allowed = _allowed_keys(parts[:-1])
        hint = f" (expected one of: {', '.join(allowed)})" if allowed else ""
        return Problem(path, f"unknown key{hint}")
    if kind in _PLAIN:
        message = _PLAIN[kind]
        if kind != "missing":
            message += f", got {_kind(value)}"
        return Problem(path, message)
    if kind in _BOUNDS:
        words, key = _BOUNDS[kind]
        limit = ctx.get(key)
        if "{}" in words:
            return Problem(path, f"{words.format(limit)}, got {_show(value)}")
        return Problem(path, f"{words} {limit}, got {_show(value)}")
    if kind == "literal_error":
        return Problem(path, f"expected one of {ctx.get('expected')}, got {_show(value)}")
    if kind == "enum":
        return Problem(path, f"expected one of {ctx.get('expected')}, got {_show(value)}")
    message = str(err.get("msg", "invalid value"))
    if kind.startswith("kazma_"):
        return Problem(path, message)
    return Problem(path, f"{message[:1].lower()}{message[1:]}, got {_show(value)}")


def _allowed_keys(parts: tuple[str | int, ...]) -> list[str]:
    """The keys a model accepts at ``parts``, for an 'unknown key' hint."""
    model: Any = KazmaConfig
    skip_key = False
    for part in parts:
        if skip_key:  # the user's own key inside a dict of models (agents.workers.<name>)
            skip_key = False
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
        info = model.model_fields.get(str(part))
        if info is None:
            return []
        model = _model_of(info.annotation)
        if model is None:
            return []
        if isinstance(model, tuple):
            model, skip_key = model[0], True
    if isinstance(model, type) and issubclass(model, BaseModel):
        return sorted(model.model_fields)
    return []


def _model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (dict,):
        value = typing.get_args(annotation)[1]
        if isinstance(value, type) and issubclass(value, BaseModel):
            return (value,)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_of(arg)
            if found is not None:
                return found
    return None
