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


@functools.cache
def _numeric_keys(model: type[BaseModel]) -> frozenset[str]:
    """The keys (names and aliases) of ``model``'s number fields."""
    keys: set[str] = set()
    for name, info in model.model_fields.items():
        if _numeric(info.annotation):
            keys.add(name)
            if info.alias:
                keys.add(info.alias)
    return frozenset(keys)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            numeric = _numeric_keys(cls)
            for key, value in data.items():
                if isinstance(value, bool) and key in numeric:
                    raise PydanticCustomError(
                        "kazma_number",
                        "expected a number, got {got}",
                        {"got": "true" if value else "false", "subpath": key},
                    )
        return data
