"""``kazma.approvals``: approval requests, the one-decision store, cards and the safety policy."""

from kazma.approvals.card import ApprovalCard, CardArgument, CardIntegrityError, build_card, button_data
from kazma.approvals.hashing import UnrenderableArguments, args_hash, canonical_json
from kazma.approvals.honesty import (
    Findings,
    Hidden,
    HiddenFinding,
    examine,
    examine_line,
    reveal,
    reveal_line,
    unreveal,
    unreveal_line,
    warnings_for,
)
from kazma.approvals.lookalikes import LookAlike, LookAlikeKind
from kazma.approvals.model import ApprovalRequest, Decision, Outcome, PressResult, PressVerdict, Status
from kazma.approvals.policy import PolicyVerdict, SafetyPolicy
from kazma.approvals.schema import MIGRATIONS
from kazma.approvals.service import (
    ApprovalRefused,
    ApprovalService,
    ButtonError,
    CardPublisher,
    ExecutionMismatch,
    parse_button,
)
from kazma.approvals.store import ApprovalStore
from kazma.approvals.tool_names import ToolNameError, check_mcp_tool_name, check_tool_name

__all__ = [
    "MIGRATIONS",
    "ApprovalCard",
    "ApprovalRefused",
    "ApprovalRequest",
    "ApprovalService",
    "ApprovalStore",
    "ButtonError",
    "CardArgument",
    "CardIntegrityError",
    "CardPublisher",
    "Decision",
    "ExecutionMismatch",
    "Findings",
    "Hidden",
    "HiddenFinding",
    "LookAlike",
    "LookAlikeKind",
    "Outcome",
    "PolicyVerdict",
    "PressResult",
    "PressVerdict",
    "SafetyPolicy",
    "Status",
    "ToolNameError",
    "UnrenderableArguments",
    "args_hash",
    "build_card",
    "button_data",
    "canonical_json",
    "check_mcp_tool_name",
    "check_tool_name",
    "examine",
    "examine_line",
    "parse_button",
    "reveal",
    "reveal_line",
    "unreveal",
    "unreveal_line",
    "warnings_for",
]
