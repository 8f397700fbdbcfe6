"""The approvals API's bodies as pydantic models: what ``POST /api/v1/approvals`` accepts, what every route answers.

The API validates with these models and its OpenAPI document (``/api/v1/openapi.json``) is generated from them,
so the two cannot drift. A refused body gets one sentence naming the field and its rule, not pydantic's report.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema
from pydantic_core import PydanticCustomError

from kazma.approvals.tool_names import TOOL_PATTERN, TOOL_RULE, ToolNameError, check_tool_name

MAX_TOOL = 100
MAX_REASON = 1000
MAX_REQUESTER = 100
MAX_DEADLINE = 7 * 24 * 3600
MAX_POLICY = 64
# An approved row whose seal does not verify: reported so, never as "approved" (the caller would act on it).
UNVERIFIED = "unverified"

# How the hash is made, for a client in another language (the README's "The card hash" says the same).
HASH_RULE = (
    "SHA-256 (lowercase hex) of the arguments' canonical JSON encoded as UTF-8. Canonical JSON is Python's "
    'json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False): no '
    "whitespace; object keys sorted by Unicode code point (not by UTF-16 unit, as RFC 8785 sorts); strings with "
    'only " and \\ escaped, \\b \\f \\n \\r \\t as such and any other character below U+0020 as \\u00xx (lowercase '
    "hex), everything else (non-ASCII, U+007F, /) as itself; integers in decimal at any size; other numbers as "
    "Python's repr of a double: the fewest significant digits that read back the same value, positional (always "
    "with a '.') when the decimal exponent is from -4 to 15, else d.ddde+XX or d.ddde-XX with at least two exponent "
    "digits (1.0, 0.1, -0.0, 0.0001, 1e-05, 1e+16, 1.5e+300); true, false, null. A number sent with a fraction "
    "or an exponent is a double (1e2 hashes as 100.0), one without is an integer"
)


def _tool_name(value: str) -> str:
    try:
        return check_tool_name(value)
    except ToolNameError as exc:
        raise PydanticCustomError("kazma_tool_name", "{problem}", {"problem": str(exc)}) from None


class NewApproval(BaseModel):
    """``POST /api/v1/approvals``: the call a person is asked to approve."""

    model_config = ConfigDict(extra="forbid", strict=True, title="NewApproval")

    tool: Annotated[
        str,
        Field(min_length=1, max_length=MAX_TOOL, description=TOOL_RULE, json_schema_extra={"pattern": TOOL_PATTERN}),
        AfterValidator(_tool_name),
    ]
    arguments: dict[str, Any] = Field(default_factory=dict, description="the call's arguments, as it will run")
    reason: str | None = Field(default=None, max_length=MAX_REASON, description="shown on the card")
    requester: str | None = Field(default=None, max_length=MAX_REQUESTER, description="on whose behalf, on the card")
    deadline_seconds: float | None = Field(
        default=None,
        gt=0,
        le=MAX_DEADLINE,
        description="then it ends as a timeout (default: approvals.deadline_seconds)",
    )
    policy: str | None = Field(
        default=None,
        max_length=MAX_POLICY,
        description="the approvals policy it is decided under (approvals.policies)",
    )


DateTime = Annotated[str, Field(json_schema_extra={"format": "date-time"})]


class Approval(BaseModel):
    """A request and its outcome, as every route answers it."""

    model_config = ConfigDict(title="Approval")

    id: str
    status: Literal["pending", "approved", "denied", "timeout", "cancelled", "unverified"]
    tool: str
    arguments: dict[str, Any]
    hash: str = Field(description=HASH_RULE)
    requested_by: str
    deadline: DateTime
    decided_by: str | None = Field(description="the identity that decided, as door:id (web:alice)")
    decided_person: str | None = Field(
        description="the person under people: who owns decided_by; null when the identity is nobody's"
    )
    decided_at: DateTime | None
    reason: str | None
    link: str
    waits: Literal["connection", "polling"] | None = Field(
        description="how a synchronous asker waits (withdrawn when it goes away); null: it may come back"
    )
    last_seen: DateTime | None = Field(description="when it last asked")


class ApiError(BaseModel):
    """Every refusal: one sentence naming what is wrong."""

    model_config = ConfigDict(title="Error")

    error: str


# The sentence a refused field gets, whatever pydantic found wrong with it.
_FIELD_RULES = {
    "tool": f"tool must be a name of 1-{MAX_TOOL} characters",
    "arguments": "arguments must be a JSON object",
    "reason": f"reason must be text of at most {MAX_REASON} characters",
    "requester": f"requester must be text of at most {MAX_REQUESTER} characters",
    "deadline_seconds": "deadline_seconds must be a number of seconds, up to 7 days",
    "policy": f"policy must be the name (text of at most {MAX_POLICY} characters) of a policy under approvals.policies",
}


class BodyRefused(ValueError):
    """A body the API does not accept; the message is the one sentence the caller gets (400)."""


def new_approval(body: dict[str, Any]) -> NewApproval:
    """``body`` as a :class:`NewApproval`, or :class:`BodyRefused` with one sentence."""
    try:
        return NewApproval.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
    unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if unknown:
        raise BodyRefused(f"unknown fields: {', '.join(unknown)}") from None
    first = errors[0]
    if first["type"] == "kazma_tool_name":
        raise BodyRefused(str(first["ctx"]["problem"])) from None
    raise BodyRefused(_FIELD_RULES[str(first["loc"][0])]) from None


def component_schemas() -> dict[str, Any]:
    """The models as OpenAPI components: NewApproval as the API validates it, the others as it writes them."""
    _, top = models_json_schema(
        [(NewApproval, "validation"), (Approval, "serialization"), (ApiError, "serialization")],
        ref_template="#/components/schemas/{model}",
    )
    schemas: dict[str, Any] = top["$defs"]
    return schemas
