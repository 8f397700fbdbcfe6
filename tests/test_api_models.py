"""The approvals API's OpenAPI document is generated from the models it validates with: a body the document's
schema accepts is one the API accepts, and the other way round, field by field (checked with jsonschema)."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kazma.bot.console.api import openapi_document
from kazma.bot.console.api_models import BodyRefused, NewApproval, component_schemas, new_approval

OPENAPI = openapi_document()
NEW = OPENAPI["components"]["schemas"]["NewApproval"]
_SCHEMA = jsonschema.Draft202012Validator(NEW)

BODIES: list[dict[str, Any]] = [
    {"tool": "deploy"},
    {"tool": "github/list_issues", "arguments": {"repo": "kazma"}, "reason": "why", "requester": "ci"},
    {"tool": "deploy", "deadline_seconds": 1},
    {"tool": "deploy", "deadline_seconds": 0.5},
    {"tool": "deploy", "deadline_seconds": 604800},
    {"tool": "deploy", "deadline_seconds": 604801},
    {"tool": "deploy", "deadline_seconds": 0},
    {"tool": "deploy", "deadline_seconds": -1},
    {"tool": "deploy", "deadline_seconds": True},
    {"tool": "deploy", "deadline_seconds": "60"},
    {"tool": "deploy", "deadline_seconds": None},
    {"tool": "deploy", "reason": None, "requester": None},
    {"tool": "deploy", "reason": "r" * 1000},
    {"tool": "deploy", "reason": "r" * 1001},
    {"tool": "deploy", "requester": "q" * 101},
    {"tool": "deploy", "reason": 5},
    {"tool": "deploy", "arguments": []},
    {"tool": "deploy", "arguments": "x"},
    {"tool": "deploy", "extra": 1},
    {},
    {"tool": ""},
    {"tool": 7},
    {"tool": "a" * 100},
    {"tool": "a" * 101},
    {"tool": "a b"},
    {"tool": "a//b"},
    {"tool": "/a"},
    {"tool": "a/"},
    {"tool": "ünï"},
    {"tool": "deploy\n"},
    {"tool": "deploy", "policy": "two-people"},
    {"tool": "deploy", "policy": 5},
    {"tool": "deploy", "policy": "p" * 65},
]


def _schema_accepts(body: dict[str, Any]) -> bool:
    return _SCHEMA.is_valid(body)


def _api_accepts(body: dict[str, Any]) -> bool:
    try:
        new_approval(body)
    except BodyRefused:
        return False
    return True


@pytest.mark.parametrize("body", BODIES, ids=[repr(b)[:40] for b in BODIES])
def test_the_document_and_the_api_accept_the_same_bodies(body: dict[str, Any]) -> None:
    assert _schema_accepts(body) == _api_accepts(body)


@settings(max_examples=300, deadline=None)
@given(st.text(st.sampled_from("ab_.-/ \n\u00e9Z9"), max_size=12))
def test_the_document_and_the_api_agree_on_every_tool_name(tool: str) -> None:
    assert _schema_accepts({"tool": tool}) == _api_accepts({"tool": tool})


def test_the_served_document_is_the_models() -> None:
    assert OPENAPI["components"]["schemas"] == component_schemas()
    assert set(component_schemas()) == {"NewApproval", "Approval", "ApiError"}
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(OPENAPI)))
    assert refs == {"NewApproval", "Approval", "ApiError"}  # every reference resolves, every model is used


def test_a_refused_field_is_one_sentence_naming_it() -> None:
    said = {}
    for body in ({"tool": "deploy", "x": 1, "y": 2}, {"tool": 7}, {"tool": "a b"}, {"tool": "d", "arguments": []}):
        with pytest.raises(BodyRefused) as refused:
            new_approval(body)
        said[repr(body)] = str(refused.value)
    assert list(said.values()) == [
        "unknown fields: x, y",
        "tool must be a name of 1-100 characters",
        "tool name 'a b' is refused: ' ' at character 2 is not allowed; a tool name is one or more parts joined by "
        "'/', each part 1-128 characters of A-Z, a-z, 0-9, '_', '.' and '-'",
        "arguments must be a JSON object",
    ]


@pytest.mark.parametrize("field", sorted(NewApproval.model_fields))
def test_every_field_refused_gets_its_sentence_never_an_error(field: str) -> None:
    """A field of the wrong kind is a 400 naming it: before, ``"policy": 5`` had no sentence and was a 500."""
    body: dict[str, Any] = {"tool": "deploy", field: [1]}
    with pytest.raises(BodyRefused) as refused:
        new_approval(body)
    assert str(refused.value).startswith(f"{field} must ")
