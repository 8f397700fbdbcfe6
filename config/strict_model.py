"""The base of every ``kazma.yaml`` model: unknown keys refused, values frozen, and no true/false for a number.

pydantic's lax mode reads ``true`` as 1 and ``false`` as 0 for an ``int`` or ``float`` field, so
``deadline_seconds: yes`` was a one-second deadline and ``max_parallel: true`` one worker, without a word. A
number written as text (what an ``${ENV}`` value is) stays accepted.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError


def _numeric(annotation: Any) -> bool:
    """Whether a field of this type takes a number (int or float, maybe optional) and never a boolean."""
    origin = typing.get_origin(annotation)
    members = typing.get_args(annotation) if origin in (typing.Union, types.UnionType) else (annotation,)
    return bool not in members and any(member in (int, float) for member in members)


def _boolean_at(annotation: Any, value: Any, where: str) -> tuple[str, bool] | None:
    """Where ``value``, read as ``annotation``, holds true/false for a number (and which): ``where`` itself, or an
    item of a list or a mapping of numbers under it (``swarm.checkpoints.<pipeline>: [true]`` was a pause after
    stage 1)."""
    if typing.get_origin(annotation) is typing.Annotated:
        return None  # a type with validators of its own (a Telegram chat id), which say what they expect
    if isinstance(value, bool):
        return (where, value) if _numeric(annotation) else None
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [member for member in args if member is not type(None)]
        return _boolean_at(members[0], value, where) if len(members) == 1 else None
    homogeneous = origin in (list, set, frozenset) or (origin is tuple and len(args) == 2 and args[1] is Ellipsis)
    if homogeneous and isinstance(value, list) and args:
        for index, item in enumerate(value):
            found = _boolean_at(args[0], item, f"{where}[{index}]")
            if found is not None:
                return found
    elif origin is dict and isinstance(value, dict) and len(args) == 2:
        for key, item in value.items():
            found = _boolean_at(args[1], item, f"{where}.{key}")
            if found is not None:
                return found
    return None


@functools.cache
def _field_types(model: type[BaseModel]) -> dict[str, Any]:
    """The keys (names and aliases) of ``model``'s fields, each with its type (what may hold a number)."""
    keys: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        keys[name] = info.annotation
        if info.alias:
            keys[info.alias] = info.annotation
    return keys


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = _field_types(cls)
            for key, value in data.items():
                if key not in fields or isinstance(value, BaseModel):
                    continue
                found = _boolean_at(fields[key], value, str(key))
                if found is not None:
                    where, got = found
                    raise PydanticCustomError(
                        "kazma_number",
                        "expected a number, got {got}",
                        {"got": "true" if got else "false", "subpath": where},
                    )
        return data
