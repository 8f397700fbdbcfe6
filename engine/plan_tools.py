"""The plan's tools: the lead writes and repairs plans; a sub-agent in the middle of a step may ask a person.

Every tool here is part of Kazma (an internal tool: no approval), and every
change it asks for is made by the executor, validated against the graph, under
the conversation's lock (invariant 9: the model owns intent, the executor owns
run state). A refusal comes back to the model as a sentence it can act on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kazma.engine.agent import ASK_USER, InternalTool, TurnContext
from kazma.engine.executor import MAX_CHOICES, PlanExecutor, RepairRefused
from kazma.engine.plan import MAX_STEP_INPUT, PlanError, PlanOrigin, PlanSpec, StepSpec
from kazma.engine.tools.registry import ToolResult, validation_problems
from kazma.engine.types import ToolSpec

PLAN_TOOL = "write_plan"


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RetryStepArgs(_Args):
    index: int = Field(ge=1, description="the failed (or interrupted) step to run again")
    input: str | None = Field(default=None, max_length=MAX_STEP_INPUT, description="new input for it; omit to keep it")


class ReplaceStepsArgs(_Args):
    from_index: int = Field(ge=1, description="every step from this one on (none may have started) is replaced")
    steps: list[StepSpec] = Field(min_length=1, max_length=50, description="the new steps, numbered from_index, …")


class SkipStepArgs(_Args):
    index: int = Field(ge=1)
    reason: str = Field(min_length=1, max_length=500)


class AbortPlanArgs(_Args):
    reason: str = Field(min_length=1, max_length=500)


A = TypeVar("A", bound=_Args)


class AskUserArgs(_Args):
    question: str = Field(min_length=1, max_length=2_000, description="what you need to know, for a person")
    choices: list[str] = Field(
        default_factory=list, max_length=MAX_CHOICES, description="answers to pick from (buttons); empty: free text"
    )


def _problems(exc: ValidationError) -> str:
    return "; ".join(validation_problems(exc))  # worded as every other tool's refusal


async def _repair(
    model: type[A], arguments: Mapping[str, Any], ctx: TurnContext, act: Callable[[A, str], Awaitable[str]]
) -> ToolResult:
    """One repair of the plan: its arguments checked, then done by the executor as the calling agent; a refusal
    of either comes back to the model as a sentence it can act on."""
    try:
        args = model.model_validate(dict(arguments))
        line = await act(args, f"agent:{ctx.agent.name}")
    except ValidationError as exc:
        return ToolResult(ok=False, output="", error=f"invalid arguments: {_problems(exc)}")
    except RepairRefused as exc:
        return ToolResult(ok=False, output="", error=f"not done: {exc}")
    return ToolResult(ok=True, output=line)


def lead_plan_tools(executor: PlanExecutor) -> list[InternalTool]:
    """``write_plan`` and the four repairs: ``retry_step``, ``replace_steps``, ``skip_step``, ``abort_plan``."""

    async def write_plan(arguments: Mapping[str, Any], ctx: TurnContext) -> ToolResult:
        try:
            spec = PlanSpec.model_validate(dict(arguments))
            # Whom the work is for: the person (ctx.starter), also in a turn the executor asked for about their
            # plan ("executor" named nobody: forbid_requester let them approve its calls, and only admins could
            # answer its questions).
            origin = PlanOrigin(text=ctx.request_text, requested_by=ctx.starter or ctx.requested_by, files=ctx.files)
            plan = await executor.start(ctx.conversation, spec, origin)
        except ValidationError as exc:
            return ToolResult(ok=False, output="", error=f"the plan is malformed: {_problems(exc)}")
        except PlanError as exc:
            return ToolResult(ok=False, output="", error=f"the plan was refused: {exc}")
        steps = ", ".join(f"{s.index}. {s.spec.title} ({s.spec.assignee})" for s in plan.steps.values())
        return ToolResult(ok=True, output=f"Plan {plan.id} started with {len(plan.steps)} steps: {steps}")

    async def retry_step(arguments: Mapping[str, Any], ctx: TurnContext) -> ToolResult:
        async def act(args: RetryStepArgs, by: str) -> str:
            return await executor.retry_step(ctx.conversation, args.index, args.input, by=by)

        return await _repair(RetryStepArgs, arguments, ctx, act)

    async def replace_steps(arguments: Mapping[str, Any], ctx: TurnContext) -> ToolResult:
        async def act(args: ReplaceStepsArgs, by: str) -> str:
            steps = [s.model_dump(mode="json") for s in args.steps]
            return await executor.replace_steps(ctx.conversation, args.from_index, steps, by=by)

        return await _repair(ReplaceStepsArgs, arguments, ctx, act)

    async def skip_step(arguments: Mapping[str, Any], ctx: TurnContext) -> ToolResult:
        async def act(args: SkipStepArgs, by: str) -> str:
            return await executor.skip_step(ctx.conversation, args.index, args.reason, by=by)

        return await _repair(SkipStepArgs, arguments, ctx, act)

    async def abort_plan(arguments: Mapping[str, Any], ctx: TurnContext) -> ToolResult:
        async def act(args: AbortPlanArgs, by: str) -> str:
            return await executor.abort_plan(ctx.conversation, args.reason, by=by)

        return await _repair(AbortPlanArgs, arguments, ctx, act)

    return [
        InternalTool(
            ToolSpec(
                PLAN_TOOL,
                "Write a plan for multi-step work. Each step goes to 'user', the lead, or a sub-agent; it starts "
                "when the steps it waits for are done. A step's input may use {{step_N.output_summary}} and "
                "{{step_N.output_files}} of a step it waits for. Every step also sees the plan's goal and the "
                "request that started it.",
                PlanSpec.model_json_schema(),
            ),
            write_plan,
        ),
        InternalTool(
            ToolSpec(
                "retry_step",
                "Run a failed or interrupted step of the current plan again, optionally with new input. "
                "The steps waiting for it go on once it is done.",
                RetryStepArgs.model_json_schema(),
            ),
            retry_step,
        ),
        InternalTool(
            ToolSpec(
                "replace_steps",
                "Replace every step of the current plan from from_index on (none of them may have started) "
                "with new steps numbered from_index, from_index+1, …",
                ReplaceStepsArgs.model_json_schema(),
            ),
            replace_steps,
        ),
        InternalTool(
            ToolSpec(
                "skip_step",
                "Count a step that has not run, or failed, as skipped: the steps waiting for it go on.",
                SkipStepArgs.model_json_schema(),
            ),
            skip_step,
        ),
        InternalTool(
            ToolSpec(
                "abort_plan", "Stop the current plan: nothing more of it runs.", AbortPlanArgs.model_json_schema()
            ),
            abort_plan,
        ),
    ]


def ask_user_tool(executor: PlanExecutor) -> InternalTool:
    """``ask_user`` for sub-agents: the step pauses until the person who asked for the plan answers."""

    async def ask_user(arguments: Mapping[str, Any], ctx: TurnContext) -> ToolResult:
        try:
            args = AskUserArgs.model_validate(dict(arguments))
        except ValidationError as exc:
            return ToolResult(ok=False, output="", error=f"invalid arguments: {_problems(exc)}")
        if ctx.step is None:
            return ToolResult(ok=False, output="", error="ask_user works only inside a step of a plan")
        try:
            question = await executor.ask_user(
                ctx.step.plan_id,
                ctx.step.index,
                ctx.step.attempt,
                args.question,
                args.choices,
                asked_by=ctx.agent.name,
            )
        except RepairRefused as exc:
            return ToolResult(ok=False, output="", error=f"not asked: {exc}")
        return ToolResult(
            ok=True,
            output=(
                f"Asked {question.answerer}. Your step is paused until they answer; you will get the answer and go "
                "on from here. End your turn now with one short line saying what you are waiting for."
            ),
        )

    return InternalTool(
        ToolSpec(
            ASK_USER,
            "Ask the person who requested this work a question you cannot answer yourself. Your step pauses "
            "until they answer; then you continue with the answer.",
            AskUserArgs.model_json_schema(),
        ),
        ask_user,
    )


__all__ = ["PLAN_TOOL", "ask_user_tool", "lead_plan_tools"]
