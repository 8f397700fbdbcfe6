"""Inbound routing and dispatch through the conversation.

A message reaches the agent it addresses (the lead when none). The plan
executor's dispatches are posted into the group *as the lead agent* and the
very same message is then handed to the addressed sub-agent through
:meth:`Conversations.on_inbound` — the path a human @-mention takes. There is
no second channel: the post is the record, and the record is the delivery.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from pydantic import ValidationError

from kazma.adapters.contract import Inbound
from kazma.config.metrics import count_failure
from kazma.engine.agent import AgentRunner, AgentSpec, InternalTool, TurnContext, TurnResult
from kazma.engine.executor import Action, ActionKind, DispatchFailed, PlanExecutor, StepResult
from kazma.engine.plan import PlanError, PlanSpec
from kazma.engine.tools import ToolResult, fence_untrusted
from kazma.engine.types import ToolSpec

log = structlog.get_logger("kazma.conversation")

SUMMARY_LIMIT = 1500
SWARM_UNAVAILABLE = "The /swarm commands are not available here: this process runs without the swarm engine."


class CommandRunner(Protocol):
    """Carries out a ``/swarm …`` command and answers in words (the swarm's commands, injected by ``bot``)."""

    async def run(self, text: str, *, actor: str, platform: str, chat: str, is_admin: bool) -> str: ...


class MessageSink(Protocol):
    async def send_text(
        self, platform: str, chat: str, text: str, *, agent: str | None = None, thread: str | None = None
    ) -> str | None: ...


@dataclass(frozen=True)
class _Dispatch:
    plan_id: str
    index: int
    attempt: int


@dataclass
class Conversations:
    sink: MessageSink
    runner: AgentRunner
    agents: Mapping[str, AgentSpec]
    lead: AgentSpec
    executor: PlanExecutor | None = None
    swarm: CommandRunner | None = None
    _dispatches: dict[tuple[str, str, str], _Dispatch] = field(default_factory=dict)
    _waiting_user: dict[str, _Dispatch] = field(default_factory=dict)  # conversation -> user step
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # told of every executor action after it is carried out (the demo and tests watch plans end)
    listeners: list[Callable[[Action], None]] = field(default_factory=list)

    def attach(self, executor: PlanExecutor) -> None:
        self.executor = executor
        self.runner.add_internal_tool(self.lead.name, InternalTool(PLAN_TOOL, self._write_plan))

    # -- inbound ---------------------------------------------------------------------------------

    async def on_inbound(self, message: Inbound) -> None:
        """Called by adapters; returns at once so platform acknowledgement windows are kept."""
        self._spawn(self._handle(message), name=f"inbound-{message.platform}-{message.message_id}")

    def _spawn(self, work: Any, name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for every running turn (tests and clean shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _handle(self, message: Inbound) -> None:
        try:
            await self._route(message)
        except Exception as exc:
            count_failure("inbound")
            log.exception("inbound.failed", platform=message.platform, chat=message.chat, error=str(exc))

    async def _route(self, message: Inbound) -> None:
        conversation = f"{message.platform}:{message.chat}"
        key = (message.platform, message.chat, message.message_id)
        dispatch = self._dispatches.pop(key, None)
        if message.command == "swarm":
            if self.swarm is None:
                reply = SWARM_UNAVAILABLE
            else:
                reply = await self.swarm.run(
                    message.text,
                    actor=message.author,
                    platform=message.platform,
                    chat=message.chat,
                    is_admin=message.is_admin,
                )
            await self.sink.send_text(message.platform, message.chat, reply, agent="swarm", thread=message.thread)
            return
        if message.from_bot and dispatch is None:
            # our own posts echoed back by the platform, or another bot: not addressed to us
            return
        worker = next((self.agents[m] for m in message.mentions if m in self.agents and m != self.lead.name), None)
        if dispatch is not None and worker is not None:
            await self._run_step(worker, conversation, message, dispatch)
            return
        waiting = self._waiting_user.pop(conversation, None)
        if waiting is not None and self.executor is not None:
            await self.executor.complete(
                waiting.plan_id,
                waiting.index,
                StepResult(ok=True, summary=message.text[:SUMMARY_LIMIT]),
                attempt=waiting.attempt,
            )
            return
        agent = worker or self.lead
        log.info("inbound.routed", conversation=conversation, agent=agent.name, author=message.author)
        result = await self.runner.run(agent, conversation, message.text, requested_by=message.author)
        await self._post_result(message, agent, result)

    async def _run_step(self, worker: AgentSpec, conversation: str, message: Inbound, dispatch: _Dispatch) -> None:
        result = await self.runner.run(worker, conversation, message.text, requested_by=message.author)
        await self._post_result(message, worker, result)
        if self.executor is None:
            return
        step = StepResult(
            ok=result.ok,
            summary=result.text[:SUMMARY_LIMIT],
            error=result.error or "",
            transient=result.transient and not result.changed_state,
        )
        await self.executor.complete(dispatch.plan_id, dispatch.index, step, attempt=dispatch.attempt)

    async def _post_result(self, message: Inbound, agent: AgentSpec, result: TurnResult) -> None:
        text = result.text if result.ok else f"I could not finish: {result.error}"
        if text:
            await self.sink.send_text(message.platform, message.chat, text, agent=agent.name, thread=message.thread)

    # -- the lead's plan tool --------------------------------------------------------------------

    async def _write_plan(self, arguments: Mapping[str, Any], ctx: TurnContext) -> ToolResult:
        assert self.executor is not None
        try:
            spec = PlanSpec.model_validate(dict(arguments))
            plan = await self.executor.start(ctx.conversation, spec)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            return ToolResult(ok=False, output="", error=f"the plan is malformed: {problems}")
        except PlanError as exc:
            return ToolResult(ok=False, output="", error=f"the plan was refused: {exc}")
        steps = ", ".join(f"{s.index}. {s.spec.title} ({s.spec.assignee})" for s in plan.steps.values())
        return ToolResult(ok=True, output=f"Plan {plan.id} started with {len(plan.steps)} steps: {steps}")

    # -- Dispatcher (the executor's hands) --------------------------------------------------------

    async def perform(self, action: Action) -> None:
        await self._perform(action)
        for listener in self.listeners:
            listener(action)

    async def _perform(self, action: Action) -> None:
        platform, _, chat = action.plan.conversation.partition(":")
        step = action.step
        if action.kind is ActionKind.DISPATCH:
            assert step is not None
            text = f"@{step.spec.assignee} {action.text}".rstrip()
            message_id = await self.sink.send_text(platform, chat, text, agent=self.lead.name)
            if message_id is None:
                raise DispatchFailed(f"the dispatch to @{step.spec.assignee} could not be posted", transient=True)
            self._dispatches[(platform, chat, message_id)] = _Dispatch(action.plan.id, step.index, step.attempts)
            inbound = Inbound(
                platform=platform,
                chat=chat,
                message_id=message_id,
                author=f"agent:{self.lead.name}",
                author_name=self.lead.name,
                text=text,
                mentions=(step.spec.assignee,),
                from_bot=True,
            )
            log.info("plan.dispatched", plan_id=action.plan.id, step=step.index, to=step.spec.assignee)
            await self.on_inbound(inbound)  # the same message, through the same inbound path
        elif action.kind is ActionKind.ASK_USER:
            assert step is not None
            await self.sink.send_text(platform, chat, action.text or step.spec.title, agent=self.lead.name)
            self._waiting_user[action.plan.conversation] = _Dispatch(action.plan.id, step.index, step.attempts)
        elif action.kind is ActionKind.RUN_LEAD:
            assert step is not None
            self._spawn(self._lead_step(action), name=f"lead-step-{action.plan.id}-{step.index}")
        elif action.kind is ActionKind.ASK_LEAD:
            prompt = f"{action.text}\nDecide what to do next and tell the team."
            self._spawn(self._lead_says(action.plan.conversation, prompt), name=f"ask-lead-{action.plan.id}")
        elif action.kind is ActionKind.FINISHED:
            summaries = "\n".join(
                f"Step {s.index} ({s.spec.assignee}, {s.status.value}): "
                + fence_untrusted(s.output_summary or s.failure_reason or "-", source=f"step {s.index}")
                for s in action.plan.steps.values()
            )
            prompt = f"The plan for '{action.plan.goal}' has finished. Report the result to the team.\n{summaries}"
            self._spawn(self._lead_says(action.plan.conversation, prompt), name=f"finish-{action.plan.id}")

    async def _lead_step(self, action: Action) -> None:
        assert action.step is not None
        assert self.executor is not None
        result = await self.runner.run(
            self.lead, action.plan.conversation, action.text or action.step.spec.title, requested_by="executor"
        )
        await self.executor.complete(
            action.plan.id,
            action.step.index,
            StepResult(ok=result.ok, summary=result.text[:SUMMARY_LIMIT], error=result.error or ""),
            attempt=action.step.attempts,
        )

    async def _lead_says(self, conversation: str, prompt: str) -> None:
        platform, _, chat = conversation.partition(":")
        result = await self.runner.run(self.lead, conversation, prompt, requested_by="executor")
        text = result.text if result.ok else f"I could not finish: {result.error}"
        if text:
            await self.sink.send_text(platform, chat, text, agent=self.lead.name)


PLAN_TOOL = ToolSpec(
    name="write_plan",
    description=(
        "Write a plan for multi-step work. Each step goes to 'user', the lead, or a sub-agent; it starts when "
        "the steps it waits for are done. A step's input may use {{step_N.output_summary}} of a step it waits for."
    ),
    parameters=PlanSpec.model_json_schema(),
)
