"""The lead agent's swarm tools: ``dispatch_swarm`` (approval unless configured otherwise), ``check_swarm_task``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kazma.approvals.policy import SafetyPolicy
from kazma.engine.agent import InternalTool, TurnContext
from kazma.engine.fence import fence_untrusted
from kazma.engine.swarm.endings import execution_of, kept_answers
from kazma.engine.swarm.registry import named, registered
from kazma.engine.swarm.roles import SHARED_OPERATORS_HINT
from kazma.engine.swarm.service import BUILTIN_PATTERNS, CHECK_DEFAULT_WAIT, CHECK_MAX_WAIT, SwarmService
from kazma.engine.swarm.store import StoreUnavailable
from kazma.engine.swarm.syntax import BRANCH, preset_named
from kazma.engine.swarm.types import SwarmRefused, SwarmRequest
from kazma.engine.tools.registry import ToolResult, validation_problems
from kazma.engine.types import ToolSpec


class DispatchSwarmArgs(BaseModel):
    # Strict, and shown on its card as validated (defaults filled in): a call of it is approved as it starts.
    model_config = ConfigDict(extra="forbid", strict=True)
    pattern: str = Field(description="a swarm pattern: " + ", ".join(p.name for p in BUILTIN_PATTERNS))
    task: str = Field(min_length=1)
    workers: list[str] = Field(
        default_factory=list, description="worker names, or ['auto'] with dispatch; conditional: [router]"
    )
    preset: str | None = Field(default=None, description="a pipeline preset from kazma.yaml")
    aggregation: Literal["collect", "first_valid", "merge_all", "vote", "best", "synthesize"] = "collect"
    routes: dict[str, str] = Field(
        default_factory=dict, description="conditional: branch name (1 to 32 of a-z 0-9 _ -) -> worker"
    )
    expect: str | None = Field(default=None, description="'json' or a schema name: every answer must match")
    deadline_seconds: int | None = Field(default=None, ge=1, le=86400)
    context: str = Field(default="", description="material every worker gets with the task, as data (256 KiB)")

    @field_validator("pattern")
    @classmethod
    def _registered(cls, value: str) -> str:
        if named(value) is None:
            raise ValueError(f"unknown pattern {value!r} (patterns: {', '.join(p.name for p in registered())})")
        return value

    # Names as /swarm reads them (syntax.Arguments), so the lead's tool takes and refuses what every surface does.

    @field_validator("workers")
    @classmethod
    def _worker_names(cls, value: list[str]) -> list[str]:
        return [name.lower() for name in value]

    @field_validator("routes")
    @classmethod
    def _branches(cls, value: dict[str, str]) -> dict[str, str]:
        routes: dict[str, str] = {}
        for branch, worker in value.items():
            name = branch.lower()
            if not BRANCH.fullmatch(name):
                # a router's answer is read for such words only: any other branch could never be chosen
                raise ValueError(f"branch {name[:40]!r} is not 1 to 32 of a-z, 0-9, '_' and '-'")
            if name in routes:
                raise ValueError(f"branch {name!r} is listed twice")
            routes[name] = worker.lower()
        return routes


def _ignored(args: DispatchSwarmArgs) -> str | None:
    """Arguments the task would run without, said instead of dropped: the lead was told the task started and
    took it to be running what it named (/swarm has no way to write them)."""
    if args.preset is not None and args.workers:
        return "give a pipeline preset or workers, not both: the preset's stages would run and the workers not"
    pattern = named(args.pattern)
    if args.routes and pattern is not None and "routes" not in {f.name for f in dataclasses.fields(pattern.command)}:
        return f"routes are a conditional's branches; {args.pattern} would not use them"
    return None


class CheckSwarmArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    task_id: str
    wait_seconds: float = Field(default=CHECK_DEFAULT_WAIT, ge=0, le=CHECK_MAX_WAIT)


def swarm_tools(service: SwarmService, policy: SafetyPolicy) -> list[InternalTool]:
    async def dispatch(arguments: Mapping[str, Any], ctx: TurnContext) -> ToolResult:
        try:
            args = DispatchSwarmArgs.model_validate(dict(arguments))
        except ValidationError as exc:
            return ToolResult(ok=False, output="", error=f"invalid arguments: {'; '.join(validation_problems(exc))}")
        ignored = _ignored(args)
        if ignored is not None:
            return ToolResult(ok=False, output="", error=f"not started: {ignored}")
        config = service.config
        operators = config.roster.human_operators()
        if len(operators) > 1 and not config.swarm.allow_shared_operators:
            # The same rule as /swarm: one task list serves everyone, so a second operator could steer this work.
            return ToolResult(
                ok=False,
                output="",
                error=f"not started: {len(operators)} human operators are configured and {SHARED_OPERATORS_HINT}",
            )
        request = SwarmRequest(
            pattern=args.pattern,
            workers=tuple(args.workers),
            prompt=args.task,
            owner=f"agent:{ctx.agent.name}",
            aggregation=args.aggregation,
            # the configured spelling, as /swarm records it; an unknown one as written, for check() to refuse
            preset=None if args.preset is None else preset_named(args.preset, config.pipelines) or args.preset,
            conversation=ctx.conversation,
            routes=tuple(args.routes.items()),
            expect=args.expect,
            deadline_seconds=args.deadline_seconds,
            context=args.context,
            started_by=ctx.starter,
        )
        try:
            # The limits, workers and options first, as every other surface refuses them before anything runs:
            # else a person was asked to approve a task the swarm then refused (an oversized one, an unknown worker).
            service.check(request, route=False)
        except SwarmRefused as exc:
            return ToolResult(ok=False, output="", error=str(exc))
        # starting swarm work is itself a call the policy sees: dangerous unless tools.dispatch_swarm says otherwise.
        # Its card shows the task as it starts, every default filled in (the aggregation, the deadline …), not the
        # arguments as sent; the request submitted below is built from these same values.
        verdict = await policy.check(
            "dispatch_swarm", args.model_dump(mode="json"), requested_by=f"agent:{ctx.agent.name}",
            conversation=ctx.conversation, started_by=ctx.starter,
        )  # fmt: skip
        if not verdict.allowed:
            return ToolResult(ok=False, output="", error=f"not started: {verdict.reason}")
        try:
            task_id = await service.submit(request)
        except SwarmRefused as exc:
            result = ToolResult(ok=False, output="", error=str(exc))
        else:
            result = ToolResult(ok=True, output=f"swarm task {task_id} started; check it with check_swarm_task")
        # The approved call ended (started, or refused): said on the audit chain, as every tool's end is. Without
        # it a restart found the approval verified and never ended, and reported it "did not run" on every card.
        await policy.ran(verdict, ok=result.ok, output=result.output, error=result.error)
        return result

    async def check(arguments: Mapping[str, Any], ctx: TurnContext) -> ToolResult:
        try:
            args = CheckSwarmArgs.model_validate(dict(arguments))
        except ValidationError as exc:
            return ToolResult(ok=False, output="", error=f"invalid arguments: {'; '.join(validation_problems(exc))}")
        try:
            record = await service.wait(args.task_id, args.wait_seconds)
        except StoreUnavailable:
            return ToolResult(ok=False, output="", error="the task store is unavailable; check again shortly")
        if record is None:
            return ToolResult(ok=False, output="", error=f"no swarm task {args.task_id!r}")
        output = record.result.get("output", "") if record.result else ""
        error = "below" if record.error else "-"
        text = f"status: {record.status.value}; step: {record.current_step}; error: {error}"
        execution = execution_of(record)
        if execution is not None:  # Kazma's own words, from its execution record: what the task's tools did
            text += f"\ntools: {execution.line()}"
        # Workers' answers and errors were written by models reading whatever their tools fetched: data, not orders.
        if record.error:
            text += "\n" + fence_untrusted(record.error, source=f"swarm task {record.id}'s error")
        if output:
            text += "\n" + fence_untrusted(str(output), source=f"swarm task {record.id}")
        for worker, answer in kept_answers(record):
            text += "\n" + fence_untrusted(answer, source=f"swarm task {record.id}: the answer {worker} finished")
        return ToolResult(ok=True, output=text)

    schema = DispatchSwarmArgs.model_json_schema()
    schema["properties"]["pattern"]["enum"] = [p.name for p in registered()]  # the patterns known as it is offered
    return [
        InternalTool(ToolSpec("dispatch_swarm", "Start work on the swarm of workers.", schema), dispatch),
        InternalTool(
            ToolSpec(
                "check_swarm_task",
                "Wait up to wait_seconds (default 60, at most 90) for a swarm task; answers as soon as it ends.",
                CheckSwarmArgs.model_json_schema(),
            ),
            check,
        ),
    ]
