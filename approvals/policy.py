"""The safety policy: which tool calls may run now, and which need a human first."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from kazma.approvals.model import Outcome
from kazma.approvals.service import ApprovalRefused, ApprovalService, ExecutionMismatch
from kazma.config.metrics import count_failure
from kazma.config.models import DangerLevel
from kazma.config.store.errors import store_errors

log = structlog.get_logger("kazma.approvals.policy")


@dataclass(frozen=True)
class PolicyVerdict:
    allowed: bool
    reason: str
    request_id: str | None = None
    outcome: Outcome | None = None
    args_hash: str | None = None  # what a person approved (None when no approval was needed)


class SafetyPolicy:
    """``check(tool, args)`` answers allowed, or opens a request and waits for its outcome.

    Tools not classified in ``tools:`` are dangerous (the floor). With no
    platform able to show a card, dangerous calls are denied at once (fail closed).
    """

    def __init__(self, service: ApprovalService) -> None:
        self.service = service

    def level(self, tool: str) -> DangerLevel:
        return self.service.config.danger_level(tool)

    async def check(
        self,
        tool: str,
        args: Mapping[str, Any],
        *,
        requested_by: str,
        conversation: str,
        task_id: str | None = None,
        deadline: float | None = None,
        notes: tuple[str, ...] = (),
        skip_rules: bool = False,
        started_by: str | None = None,
        defined_since: float | None = None,
        definition_hash: str | None = None,
    ) -> PolicyVerdict:
        """``notes``: how the call would run, said on its card (e.g. "runs unsandboxed on this host").
        ``skip_rules``: a card even where a remembered approval would let the call run (it may have run already).
        ``started_by``: whose message started the work (a policy's ``forbid_requester`` refuses their Approve).
        ``definition_hash``: the digest of the tool's definition now (None: fixed in Kazma's code): the request
        records it, and a remembered approval stands only for the definition it was made for.
        ``defined_since``: when that definition was first seen (epoch seconds): a remembered approval that names no
        definition (made before they were recorded) made on a card shown before it was made for another tool."""
        level = self.level(tool)
        if level is not DangerLevel.DANGEROUS:
            return PolicyVerdict(True, f"{tool} is classified {level.value}")
        config = self.service.config
        name = config.policy_name_for(tool)
        chosen = config.policy(name)
        # A remembered approval is one person's press: never for a policy of several people or a passkey.
        rememberable = chosen is not None and chosen.single and not skip_rules
        rule = None
        if rememberable:
            try:
                rule = await self.service.remembered(
                    tool, args, conversation, started_by=started_by, defined_since=defined_since,
                    definition_hash=definition_hash,
                )  # fmt: skip
            except store_errors() as exc:
                # The rules could not be read: the call is asked on a card (the safe side; an error here ended the
                # agent's turn on it). A rule that would have let it run is lost for this call: counted.
                count_failure("approval_rule_read")
                log.warning("approvals.rules_unread", tool=tool, requested_by=requested_by, error=str(exc))
        if rule is not None:
            return PolicyVerdict(
                True,
                f"Ran under remembered approval {rule.id} made by {rule.created_by} (no card).",
                rule.request_id,
                args_hash=rule.args_hash,
            )
        publisher = self.service.publisher
        if publisher is None or not publisher.can_show_cards(name):
            count_failure("approval_fail_closed")
            log.warning("approvals.fail_closed", tool=tool, requested_by=requested_by, policy=name)
            return PolicyVerdict(
                False,
                f"{tool} needs approval, but no platform can show an approval card "
                "(none is configured or connected where its policy sends cards), so it was refused.",
            )
        try:
            request = await self.service.open(
                tool, args, requested_by, conversation, deadline=deadline, task_id=task_id, notes=notes,
                started_by=started_by, definition_hash=definition_hash,
            )  # fmt: skip
        except ApprovalRefused as exc:
            return PolicyVerdict(False, str(exc))
        except store_errors() as exc:
            # The store refused the request's opening: nothing is open, nothing runs, and the turn goes on to
            # tell the person (an error here ended the whole turn in silence).
            count_failure("approval_open")
            log.warning("approvals.open_failed", tool=tool, requested_by=requested_by, error=str(exc))
            return PolicyVerdict(
                False,
                f"{tool} needs approval, but its request could not be opened (the approvals store failed: {exc}), "
                "so it did not run; ask again.",
            )
        outcome = await self.service.wait(request.id)
        if not outcome.approved:
            return PolicyVerdict(False, outcome.for_agent(), request.id, outcome)
        try:
            await self.service.verify_execution(request.id, tool, args)
        except ExecutionMismatch as exc:
            return PolicyVerdict(False, f"Refused: {exc}", request.id, outcome)
        return PolicyVerdict(True, outcome.for_agent(), request.id, outcome, args_hash=request.args_hash)

    async def ran(self, verdict: PolicyVerdict, *, ok: bool, output: str, error: str | None) -> None:
        """The call a person approved has run: its ending goes on the audit chain with its decision."""
        if verdict.request_id is not None and verdict.outcome is not None and verdict.outcome.approved:
            await self.service.execution_finished(verdict.request_id, ok=ok, output=output, error=error)
