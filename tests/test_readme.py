"""The README's configuration reference must list exactly the keys the model accepts."""

from __future__ import annotations

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
    keys = {k.replace("tools.levels.<name>", "tools.<name>") for k in model_keys(KazmaConfig)}
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
