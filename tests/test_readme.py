"""The README's configuration reference must list exactly the keys the model accepts."""

from __future__ import annotations

import contextlib
import re
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kazma.config import KazmaConfig
from kazma.config.registry import ACTOR_PLATFORMS

README = Path(__file__).resolve().parent.parent / "README.md"


def model_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        sub = _submodel(info.annotation)
        origin = typing.get_origin(info.annotation)
        if sub is not None:
            keys |= model_keys(sub, path + ".")
        elif origin is dict:
            value = typing.get_args(info.annotation)[1]
            if isinstance(value, type) and issubclass(value, BaseModel):
                keys |= model_keys(value, path + ".<name>.")
            else:
                keys.add(path + ".<name>")
        else:
            keys.add(path)
    return keys


def _submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    # an optional section (``audit.sink: … | None``): its keys are documented as the section's own
    members = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(members) == 1:
        return _submodel(members[0])
    return None


def documented_keys() -> set[str]:
    text = README.read_text()
    section = text.split("### Keys", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_.<>]+)` \|", section, flags=re.MULTILINE))


def test_every_key_is_documented_and_nothing_else() -> None:
    # tools.<name> levels sit beside the tools.* settings in kazma.yaml; the model keeps them in `levels`.
    # people.<name>.<door> sit beside people.groups in kazma.yaml; the model keeps the people in `persons`.
    # tools.<name>: {policy: …} is kept in `policies`.
    keys = {
        k.replace("tools.levels.<name>", "tools.<name>").replace("tools.policies.<name>", "tools.<name>.policy")
        for k in model_keys(KazmaConfig)
    }
    persons = {k for k in keys if k.startswith("people.persons.")}
    expected = (keys - persons) | ({f"people.<name>.{door}" for door in ACTOR_PLATFORMS} if persons else set())
    documented = documented_keys()
    assert sorted(expected - documented) == [], "keys missing from the README"
    assert sorted(documented - expected) == [], "README documents keys the model does not accept"


def test_readme_names_the_test_command_that_ci_runs() -> None:
    readme = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    command = re.search(r"## Test\s+```sh\n(.+?)\n```", readme, flags=re.DOTALL)
    assert command is not None
    assert command.group(1).strip() in ci


def _field_at(key: str) -> Any:
    """The model field a documented key names (``<name>`` steps into a dict's value model), or None."""
    model: Any = KazmaConfig
    info: Any = None
    parts = key.split(".")
    index = 0
    while index < len(parts):
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        info = model.model_fields.get(parts[index])
        if info is None:
            return None
        index += 1
        sub = _submodel(info.annotation)
        if typing.get_origin(info.annotation) is dict and index < len(parts) and parts[index] == "<name>":
            value = typing.get_args(info.annotation)[1]
            sub = value if isinstance(value, type) and issubclass(value, BaseModel) else None
            index += 1
        if sub is not None:
            model = sub
    return info


def _written(value: Any) -> str | None:
    """A default as kazma.yaml would spell it; None when it has no one literal spelling."""
    value = getattr(value, "value", value)  # an enum
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str | Path):
        return str(value)
    if value == [] or value == ():
        return "[]"
    return None


def test_every_literal_default_in_the_readme_is_the_models() -> None:
    # A default column that says `${TELEGRAM_BOT_TOKEN:-}` while the model's default is empty told people a
    # section without `token:` reads the variable; it does not, and the platform stayed off.
    text = README.read_text()
    section = text.split("### Keys", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_.<>]+)` \| `([^`|]*)` \|", section, flags=re.MULTILINE)
    assert len(rows) > 100
    wrong = []
    for key, documented in rows:
        info = _field_at(key)
        if info is None or info.is_required():
            continue
        default = info.get_default(call_default_factory=True)
        written = _written(default)
        if written is None:
            continue
        same = written == documented or (written, documented) in {("false", "off"), ("true", "on")}
        if not same:
            with contextlib.suppress(ValueError):
                same = float(written) == float(documented)
        if not same:
            wrong.append(f"{key}: README `{documented}`, the model {written!r}")
    assert wrong == []


def test_the_swarm_table_lists_every_subcommand_with_who_may_run_it() -> None:
    from kazma.engine.swarm.grammar import USAGES
    from kazma.engine.swarm.syntax import Access

    section = README.read_text().split("## The `/swarm` commands", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `([^`]*)`(?: / `([^`]*)`)? \| (\w+) \|", section, flags=re.MULTILINE)
    who = {usage.split()[0]: person for first, second, person in rows for usage in (first, second) if usage}
    assert sorted(who) == sorted(USAGES), "the README's /swarm table and the grammar's subcommands differ"
    expected = {verb: "anyone" if usage.access is Access.READ else "admin" for verb, usage in USAGES.items()}
    assert who == expected
