"""Agents and the bounded turn loop: model → tool calls → safety policy → execute → repeat."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog

from kazma.approvals.hashing import MAX_ARGUMENT_DEPTH, UnrenderableArguments, args_hash, check_arguments, nesting_depth
from kazma.approvals.model import Status
from kazma.approvals.policy import PolicyVerdict, SafetyPolicy
from kazma.config import failpoints
from kazma.config.limits import MAX_TOOL_OUTPUT_CHARS
from kazma.config.metrics import count_failure
from kazma.config.models import DangerLevel, KazmaConfig
from kazma.config.store.errors import simulated_failure
from kazma.engine import answer_stream, messages
from kazma.engine.answer_stream import AnswerStream
from kazma.engine.fence import fence_untrusted
from kazma.engine.history import HistoryStore
from kazma.engine.tools.executions import (
    Effects,
    Ended,
    Execution,
    ExecutionRecord,
    ExecutionSummary,
    Fence,
    FencedOut,
    Ran,
    current_fence,
    current_scope,
    note,
    step_scope,
    tracking,
)
from kazma.engine.tools.registry import InvalidArguments, ToolRegistry, ToolResult
from kazma.engine.tools.workspace import ToolContext
from kazma.engine.types import Message, ModelError, ModelProvider, ToolCall, ToolSpec, ToolUse, Usage

log = structlog.get_logger("kazma.agent")

MAX_TOOL_OUTPUT_TO_MODEL = MAX_TOOL_OUTPUT_CHARS
# Tool calls one model reply may make; the rest are answered "not run" (each call needs an answer) without running.
# A reply of hundreds of calls (a model looping, or told to by text it read) put a card after card in front of
# people, each waited for in turn, for as long as every deadline together.
MAX_CALLS_PER_REPLY = 32
# The plan tool a step's sub-agent asks a person with: the step waits for the answer once it has returned.
ASK_USER: Final = "ask_user"
# An execution's ending that could not be written is written again after these pauses (seconds).
FINISH_RETRIES = (0.05, 0.25, 1.0)
DANGEROUS = DangerLevel.DANGEROUS
# Said on the card of a call that started here before and never finished.
MAY_HAVE_RUN_NOTE = (
    "This exact call started here before and never finished (Kazma stopped, or it was cut off): it may have "
    "run already. Check before approving it again."
)
_SAFE_SEGMENT = re.compile(r"[^A-Za-z0-9_-]+")
_WORKSPACE_NAME_LIMIT = 100
# Conversation ids whose plain workspace name (see workspace_for) no other id of these shapes has: each shape's
# names decode back to the id (a platform has no "_"; a chat neither starts nor ends with one; a Matrix room's
# localpart and server labels have none), and the shapes' names differ (no "_", "<platform>_" with a platform
# other than matrix, "matrix_").
_PLAIN_IDS: Final = (
    re.compile(r"[A-Za-z0-9-]+"),  # an id of Kazma's own ("swarm")
    re.compile(r"(?!matrix:)[a-z]+:[A-Za-z0-9-](?:[A-Za-z0-9_-]*[A-Za-z0-9-])?"),  # telegram:-100…, slack:C…, web:…
    re.compile(r"matrix:![A-Za-z0-9]+:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*"),  # a room !opaque:server (no port)
)


@dataclass(frozen=True)
class AgentSpec:
    name: str
    system_prompt: str
    tools: tuple[str, ...] = ()
    model: str | None = None
    is_lead: bool = False


def agents_from_config(config: KazmaConfig) -> dict[str, AgentSpec]:
    lead = config.agents.lead
    agents = {
        lead.name: AgentSpec(lead.name, lead.system_prompt, tuple(lead.tools), lead.model, is_lead=True),
    }
    for name, worker in config.agents.workers.items():
        agents[name] = AgentSpec(name, worker.system_prompt, tuple(worker.tools), worker.model)
    return agents


# An internal tool is part of Kazma itself (the lead's plan tool): it changes no
# state outside Kazma and goes through no approval.
InternalHandler = Callable[[Mapping[str, Any], "TurnContext"], Awaitable[ToolResult]]


@dataclass(frozen=True)
class InternalTool:
    spec: ToolSpec
    handler: InternalHandler


def denial_reason(verdict: PolicyVerdict) -> str:
    """A person's reason for denying the call, for the model: their words, fenced (never instructions); ''
    when they gave none."""
    outcome = verdict.outcome
    if outcome is None or outcome.status is not Status.DENIED or not outcome.reason:
        return ""
    return "\n" + fence_untrusted(outcome.reason, source=f"the reason {outcome.decider} gave for denying this call")


@dataclass(frozen=True)
class StepRef:
    """The plan step a turn works on: which plan, which step, which attempt of it."""

    plan_id: str
    index: int
    attempt: int


@dataclass(frozen=True)
class TurnContext:
    conversation: str
    agent: AgentSpec
    requested_by: str
    task_id: str | None = None
    request_text: str = ""  # what the turn was asked (a plan written in it remembers it)
    step: StepRef | None = None  # the plan step this turn works on, if any
    files: tuple[str, ...] = ()  # workspace paths of files sent with the message (a plan written in it keeps them)
    # Who started the work this turn serves, when it is not ``requested_by`` (a plan's step: the person whose
    # message started the plan): whom a policy's forbid_requester refuses.
    started_by: str | None = None
    # Asked just before each tool starts (a plan step's turn: is the step still this turn's to run?). It stops the
    # turn by cancelling it, or raises when it cannot tell; a tool starts only once it has returned.
    before_tool: Callable[[], Awaitable[None]] | None = None
    # What each tool's execution row is written under (a plan step's: the step is still this turn's). The check
    # and the row are one statement, so a step taken away between ``before_tool`` and the row runs no tool.
    fence: Fence | None = None

    @property
    def starter(self) -> str | None:
        """Whom the work this turn serves is for, as a policy's forbid_requester sees it: ``started_by``, else
        ``requested_by`` when that is an identity (a person's message), else nobody known."""
        return self.started_by or (self.requested_by if ":" in self.requested_by else None)


@dataclass(frozen=True)
class ToolRun:
    name: str
    arguments: dict[str, Any]
    ok: bool
    summary: str
    refused: bool = False
    changed_state: bool = False
    approval_id: str | None = None  # the request a person decided for this call (None: none was needed)

    def use(self) -> ToolUse:
        return ToolUse(self.name, self.ok, self.approval_id, self.refused)


@dataclass
class TurnResult:
    text: str
    tool_runs: list[ToolRun] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    error: str | None = None
    transient: bool = False
    retry_after: float | None = None  # a transient model error's own word on when to try again
    model: str = ""  # the model that answered last, as its server named it
    execution: ExecutionSummary = field(default_factory=ExecutionSummary)  # what the turn's tools did

    @property
    def tools(self) -> tuple[ToolUse, ...]:
        return tuple(run.use() for run in self.tool_runs)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def changed_state(self) -> bool:
        return any(run.changed_state for run in self.tool_runs)

    @property
    def files_written(self) -> tuple[str, ...]:
        """Workspace paths this turn wrote, in order, once each: a step's output files."""
        paths = [str(run.arguments.get("path")) for run in self.tool_runs if run.name == "write_file" and run.ok]
        return tuple(dict.fromkeys(p for p in paths if p and p != "None"))


def offers(patterns: tuple[str, ...], name: str) -> bool:
    """Whether an agent's ``tools`` (names, or ``server/*`` for every tool of an MCP server) include ``name``."""
    return any(p == name or (p.endswith("/*") and name.startswith(p[:-1])) for p in patterns)


def own_ids(calls: Sequence[ToolCall], taken: set[str]) -> tuple[ToolCall, ...]:
    """``calls`` with an id each that no other call of the turn has (``taken``: the turn's ids so far, added to).

    Some servers give several calls one id (in one reply, or ``call_0`` in every reply); sent back so, the result
    of each is not told from the others', and OpenAI-compatible servers refuse the request ("Duplicate value for
    'tool_call_id'"). A repeated id gets a suffix; the model reads its calls back under the ids sent with them.
    """
    unique: list[ToolCall] = []
    for call in calls:
        call_id, n = call.id, 1
        while call_id in taken:
            n += 1
            call_id = f"{call.id}_{n}"
        taken.add(call_id)
        unique.append(call if call_id == call.id else dataclasses.replace(call, id=call_id))
    return tuple(unique)


def cut_for_model(text: str, limit: int = MAX_TOOL_OUTPUT_TO_MODEL) -> str:
    """``text`` whole when it fits in ``limit`` characters; else its head and tail around a marker saying how much
    is left out.

    Tools bound their own output more loosely (a shell's 64 KiB, a file's 256 KiB), and end it with what matters
    most: a command's exit code, the last lines of its errors. Cut at the front alone, the model read the first
    16,000 characters as the whole output, with no exit code and no sign that anything was missing."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[… {cut} of {len(text)} characters cut here …]\n{text[-tail:]}"


def _not_run(call: ToolCall, result: TurnResult, problem: str, hint: str) -> str:
    """A call refused before anything ran: recorded as refused (its arguments not kept), and the model told why."""
    result.tool_runs.append(ToolRun(call.name, {}, False, problem, refused=True))
    return f"Error: the call to {call.name} was not run: {problem}. {hint}"


def workspace_for(root: Path, conversation: str) -> Path:
    """One directory per conversation, named so that no conversation id can escape ``root`` and no two
    conversations share one.

    The name is the id with every run of other characters than letters, digits, ``_`` and ``-`` turned into
    ``_`` (the name workspaces always had) where that cannot be another conversation's too: an id of the shapes
    in :data:`_PLAIN_IDS` (Telegram, Discord, Slack, the console, a Matrix room ``!id:server``, the swarm's), at
    most 100 characters. Any other id (one whose name would have lost characters: ``!a.b:x`` and ``!a~b:x``, or
    been cut at 100 characters) is named by that same text, shortened, a ``.`` and a digest of the whole id: a
    name with a dot, which a name of the first kind never has.
    """
    safe = _SAFE_SEGMENT.sub("_", conversation).strip("._")
    if len(safe) <= _WORKSPACE_NAME_LIMIT and any(shape.fullmatch(conversation) for shape in _PLAIN_IDS):
        return root / safe
    digest = hashlib.sha256(conversation.encode("utf-8", "surrogatepass")).hexdigest()[:24]
    return root / f"{safe[:60].rstrip('._') or 'conversation'}.{digest}"


class AgentRunner:
    def __init__(
        self,
        provider: ModelProvider,
        registry: ToolRegistry,
        policy: SafetyPolicy,
        history: HistoryStore,
        *,
        workspace_root: Path,
        max_steps: int = 8,
        executions: ExecutionRecord | None = None,
        own_tools: Callable[[str], Sequence[InternalTool]] | None = None,
    ) -> None:
        self.provider = provider
        self.registry = registry
        self.policy = policy
        self.history = history
        self.workspace_root = workspace_root
        self.max_steps = max_steps
        # Every tool execution's row before it starts and when it ends (None: not recorded, as in some tests).
        self.executions = executions
        # An agent's internal tools, by its name, asked for at each turn: they start plans and swarm work,
        # which run agents through this runner, so they are made after it.
        self.own_tools = own_tools

    def _internal(self, agent: AgentSpec, extra: Sequence[InternalTool]) -> dict[str, InternalTool]:
        own = self.own_tools(agent.name) if self.own_tools is not None else ()
        return {**{t.spec.name: t for t in own}, **{t.spec.name: t for t in extra}}

    def _specs(self, agent: AgentSpec, extra: Sequence[InternalTool] = ()) -> list[ToolSpec]:
        specs = [t.spec for t in self._internal(agent, extra).values()]
        usable: list[str] = []
        for pattern in agent.tools:
            found = self.registry.matching(pattern)
            if not found:
                log.warning("agent.unknown_tool", agent=agent.name, tool=pattern)
            usable += [name for name in found if name not in usable]
        return specs + self.registry.specs(usable)

    async def run(
        self,
        agent: AgentSpec,
        conversation: str,
        text: str,
        *,
        requested_by: str,
        task_id: str | None = None,
        step: StepRef | None = None,
        extra_tools: Sequence[InternalTool] = (),
        files: Sequence[str] = (),
        request_text: str | None = None,
        stream: AnswerStream | None = None,
        started_by: str | None = None,
        before_tool: Callable[[], Awaitable[None]] | None = None,
        fence: Fence | None = None,
    ) -> TurnResult:
        """One turn: the agent answers ``text``, calling tools as it goes, at most ``max_steps`` model calls.

        ``extra_tools`` are internal tools offered for this turn only (the swarm's handoff tool). ``files`` are
        the workspace paths of files sent with the message, and ``request_text`` what the person wrote (default
        ``text``): a plan written in the turn keeps both. ``stream`` is shown each reply's text while the model
        writes it (model calls only: the tools the turn runs write into nothing of it). ``started_by``: who started
        the work when that is not ``requested_by`` (a plan's steps run for the person who asked for the plan).
        ``before_tool`` is awaited just before each tool of the turn starts, and each tool's execution row is
        written under ``fence`` (see :class:`TurnContext`).
        """
        ctx = TurnContext(
            conversation,
            agent,
            requested_by,
            task_id,
            request_text=text if request_text is None else request_text,
            step=step,
            files=tuple(files),
            started_by=started_by,
            before_tool=before_tool,
            fence=fence,
        )
        sent: list[Message] = [
            messages.system(agent.system_prompt),
            *await self.history.recent(conversation, agent.name),
            messages.user(text),
        ]
        result = TurnResult(text="")
        scope = "" if step is None else step_scope(step.plan_id, step.index, step.attempt)
        with tracking(Effects(scope=scope)) as effects:
            await self._turn(agent, conversation, text, ctx, sent, result, extra_tools, stream)
        result.execution = effects.summary()
        return result

    async def _turn(
        self,
        agent: AgentSpec,
        conversation: str,
        text: str,
        ctx: TurnContext,
        sent: list[Message],
        result: TurnResult,
        extra_tools: Sequence[InternalTool],
        stream: AnswerStream | None = None,
    ) -> None:
        specs = self._specs(agent, extra_tools)
        internal = self._internal(agent, extra_tools)
        answered: set[str] = set()  # the tool-call ids this turn has sent back
        for _ in range(self.max_steps):
            try:
                if failpoints.armed and result.tool_runs:  # a tool's result recorded, on its way back to the model
                    await failpoints.reached(
                        "tools.recorded", lambda: ModelError("the connection was reset (failpoint)", permanent=False)
                    )
                with answer_stream.feeding(stream):
                    reply = await self.provider.complete(sent, specs, model=agent.model)
            except ModelError as exc:
                count_failure("model")
                log.warning("agent.model_error", agent=agent.name, error=str(exc), permanent=exc.permanent)
                result.error = f"the model could not answer: {exc}"
                result.transient = not exc.permanent and not result.changed_state
                result.retry_after = exc.retry_after
                return
            result.usage = result.usage + reply.usage
            result.model = reply.model or agent.model or result.model
            if not reply.tool_calls:
                result.text = (reply.content or "").strip()
                await self._remember(conversation, agent.name, text, result)
                return
            calls = own_ids(reply.tool_calls, answered)
            sent.append(messages.assistant_calls(reply.content, calls))
            if len(calls) > MAX_CALLS_PER_REPLY:
                log.warning("agent.too_many_calls", agent=agent.name, conversation=conversation, calls=len(calls),
                            ran=MAX_CALLS_PER_REPLY)  # fmt: skip
            for index, call in enumerate(calls):
                if index < MAX_CALLS_PER_REPLY:
                    content = await self._call(call, ctx, result, internal)
                else:
                    problem = f"one reply may make at most {MAX_CALLS_PER_REPLY} tool calls; this was call {index + 1}"
                    content = _not_run(call, result, problem, "Send it again in your next reply.")
                sent.append(messages.tool_reply(call.id, content))
        result.error = f"stopped after {self.max_steps} model calls without a final answer"
        log.warning("agent.turn_limit", agent=agent.name, conversation=conversation)

    async def _may_have_run(self, call: ToolCall, ctx: TurnContext) -> Execution | None:
        if self.executions is None:
            return None
        try:
            digest = args_hash(call.arguments)
        except ValueError:  # arguments nothing can hash are refused by the policy anyway
            return None
        try:
            return await self.executions.may_have_run(call.name, digest, ctx.conversation)
        except Exception as exc:  # the card is shown anyway (a remembered approval is the only thing skipped)
            log.warning("agent.execution_lookup_failed", tool=call.name, error=str(exc))
            return None

    async def _start_record(
        self, call: ToolCall, ctx: TurnContext, request_id: str | None, approved: str | None, ran: Ran
    ) -> str | None:
        """The execution's row, committed before it starts (None: nothing records executions here)."""
        if self.executions is None:
            return None
        record = self.executions
        if failpoints.armed:
            await failpoints.reached("tools.verified", lambda: simulated_failure(record.tables, "execution record"))
        scope, task_id = current_scope()
        return await record.started(
            tool=call.name,
            args_hash=approved or args_hash(call.arguments),
            request_id=request_id,
            conversation=ctx.conversation,
            agent=ctx.agent.name,
            changes_state=ran.changes_state,
            scope=scope,
            task_id=task_id or ctx.task_id,
            fence=ctx.fence or current_fence(),
        )

    async def _unasked(
        self, call: ToolCall, ctx: TurnContext, result: TurnResult, verdict: PolicyVerdict | None
    ) -> str | None:
        """The turn's ``before_tool`` asked; None when the call may start, else the model's answer (not run)."""
        if ctx.before_tool is None:
            return None
        try:
            await ctx.before_tool()
        except Exception as exc:  # a step that cannot be read back may be another replica's by now
            count_failure("step_watch")
            log.warning("agent.step_unread", agent=ctx.agent.name, tool=call.name, error=str(exc))
            why = (
                "whether its plan step still runs here could not be read (the store is unavailable), so it did not run"
            )
            approval = None if verdict is None else verdict.request_id
            result.tool_runs.append(ToolRun(call.name, call.arguments, False, why, refused=True, approval_id=approval))
            return f"Not run: {why}; ask again."
        return None

    async def _finish_record(self, ran: Ran, error: str) -> None:
        """The execution's ending on its row: tried a few times; one never written reads "may have run" later."""
        if self.executions is None or ran.execution_id is None or ran.ended is None:
            return
        for attempt, pause in enumerate((*FINISH_RETRIES, None)):
            try:
                if failpoints.armed:
                    await failpoints.reached(
                        "tools.finished", lambda: simulated_failure(self.executions, "execution record")
                    )
                await self.executions.finished(ran.execution_id, ran.ended, exit_code=ran.exit_code, error=error)
                return
            except Exception as exc:
                count_failure("execution_record")
                log.warning("agent.execution_end_unrecorded", execution=ran.execution_id, tool=ran.tool,
                            attempt=attempt + 1, error=str(exc))  # fmt: skip
                if pause is None:
                    return
                await asyncio.sleep(pause)

    async def _remember(self, conversation: str, agent: str, text: str, result: TurnResult) -> None:
        """The finished exchange into the agent's history. A store that cannot take it (locked past its busy
        timeout, gone) costs the next turns this exchange, never this turn its answer."""
        try:
            await self.history.append_exchange(
                conversation,
                agent,
                text,
                result.text,
                prompt_tokens=result.usage.prompt_tokens,
                completion_tokens=result.usage.completion_tokens,
            )
        except Exception as exc:
            count_failure("history")
            log.warning("agent.history_unrecorded", agent=agent, conversation=conversation, error=str(exc))

    async def _call(
        self, call: ToolCall, ctx: TurnContext, result: TurnResult, tools: Mapping[str, InternalTool]
    ) -> str:
        """Run one tool call; whatever happens, the model gets an answer it can act on."""
        name = self.registry.canonical(call.name)
        if name != call.name:  # a model-safe alias (``server__tool``): the card and the record say ``server/tool``
            call = ToolCall(call.id, name, call.arguments, call.raw_arguments, call.error)
        if call.error is not None:
            result.tool_runs.append(ToolRun(call.name, {}, False, call.error))
            return f"Error: the arguments of {call.name} could not be read ({call.error}). Send a JSON object."
        depth = nesting_depth(call.arguments)
        if depth > MAX_ARGUMENT_DEPTH:
            problem = f"arguments nested {depth} levels deep (at most {MAX_ARGUMENT_DEPTH})"
            result.tool_runs.append(ToolRun(call.name, {}, False, problem, refused=True))
            return f"Error: the call to {call.name} was not run: its {problem}. Send flatter arguments."
        if ctx.step is not None and any(run.name == ASK_USER and run.ok for run in result.tool_runs):
            # The step waits for the person's answer from here on, and the turn resumed with it does the rest: a
            # call after it was still put to an approver (a card) and then refused at its start, whatever they
            # decided; a second question was refused only after the store was read.
            why = "your step waits for the answer to your question, and you go on from there once it comes"
            log.info("agent.call_after_question", agent=ctx.agent.name, tool=call.name,
                     plan=ctx.step.plan_id, step=ctx.step.index)  # fmt: skip
            result.tool_runs.append(ToolRun(call.name, call.arguments, False, why, refused=True))
            return f"Not run: {why}. End your turn now with one short line saying what you are waiting for."
        internal = tools.get(call.name)
        if internal is not None:
            unasked = await self._unasked(call, ctx, result, None)
            if unasked is not None:
                return unasked
            outcome = await internal.handler(call.arguments, ctx)
            result.tool_runs.append(
                ToolRun(call.name, call.arguments, outcome.ok, outcome.output or outcome.error or "")
            )
            return outcome.output if outcome.ok else f"Error: {outcome.error}"
        if not offers(ctx.agent.tools, call.name) or call.name not in self.registry:
            allowed = ", ".join([*tools, *ctx.agent.tools]) or "none"
            result.tool_runs.append(ToolRun(call.name, call.arguments, False, "not available", refused=True))
            return f"Error: {call.name} is not one of your tools (yours: {allowed})."
        try:
            # Here, not only when a card is opened: a call that needs no card is still hashed for its execution
            # record, and one whose arguments cannot be (a lone surrogate, NaN) read "the store is unavailable".
            check_arguments(call.arguments)
        except UnrenderableArguments as exc:
            problem = f"its arguments cannot be shown or recorded exactly ({exc})"
            return _not_run(call, result, problem, "Send valid text and finite numbers.")
        refusal = self.registry.refusal(call.name)
        if refusal is not None:
            result.tool_runs.append(ToolRun(call.name, call.arguments, False, refusal, refused=True))
            return f"Not run: {refusal}"
        try:
            # The call as it would run, defaults filled in: the card shows it, its hash covers it, and that hash is
            # checked again just before it runs. Arguments its tool refuses are refused here, before any card.
            prepared = self.registry.prepare(call.name, call.arguments)
        except InvalidArguments as exc:
            log.info("agent.invalid_arguments", agent=ctx.agent.name, tool=call.name, problems=exc.problems)
            return _not_run(call, result, str(exc), "Send the arguments its schema asks for, of the types it names.")
        call = ToolCall(call.id, call.name, prepared, call.raw_arguments, call.error)
        notes = (*self.registry.notes(call.name), *self.registry.call_notes(call.name, call.arguments))
        # The tool as the card will show it, as the digest the card binds: compared below before a row is
        # written, and by execute last, where nothing is awaited before the send.
        shown_digest = self.registry.definition_digest(call.name)
        earlier = await self._may_have_run(call, ctx)
        if earlier is not None:
            # The same call started here before and never finished: it may have run. A remembered approval must
            # not run it again unasked, and the card says why it is back.
            notes = (*notes, MAY_HAVE_RUN_NOTE)
        verdict = await self.policy.check(
            call.name,
            call.arguments,
            requested_by=f"agent:{ctx.agent.name}",
            conversation=ctx.conversation,
            task_id=ctx.task_id,
            notes=notes,
            skip_rules=earlier is not None,
            started_by=ctx.starter,
            defined_since=self.registry.defined_since(call.name),
            definition_hash=shown_digest,
        )
        if not verdict.allowed:
            result.tool_runs.append(
                ToolRun(call.name, call.arguments, False, verdict.reason, refused=True, approval_id=verdict.request_id)
            )
            return f"Not run: {verdict.reason}" + denial_reason(verdict)
        if self.registry.definition_digest(call.name) != shown_digest:
            # Its server listed it again while the call waited (a new description, schema or default): the person
            # approved a call of the tool as it was, not as it is now. Checked here to refuse before a row is
            # written; the store is awaited below, so execute compares the digest again where nothing can change.
            why = (
                f"{call.name} changed on its server while the call waited for approval (its description, arguments "
                "or hints are not what the card showed); nothing ran, ask again"
            )
            count_failure("tool_changed")
            log.warning("agent.tool_changed", agent=ctx.agent.name, tool=call.name, approval=verdict.request_id)
            await self.policy.ran(verdict, ok=False, output="", error=f"not run: {why}")
            result.tool_runs.append(
                ToolRun(call.name, call.arguments, False, why, refused=True, approval_id=verdict.request_id)
            )
            return f"Not run: {why}."
        tool_ctx = ToolContext(
            workspace=workspace_for(self.workspace_root, ctx.conversation),
            conversation=ctx.conversation,
            approved_hash=verdict.args_hash,
            agent=ctx.agent.name,
            definition_hash=shown_digest,
        )
        ran = Ran(call.name, self.registry.changes_state(call.name) or self.policy.level(call.name) is DANGEROUS)
        # Here, after the approval (a wait of minutes), just before the row: what the turn runs for may have been
        # taken away meanwhile (its step failed elsewhere as interrupted), and its tool must not act twice.
        try:
            unasked = await self._unasked(call, ctx, result, verdict)
        except asyncio.CancelledError:  # its step taken away: the approved call never runs, said on its chain
            await asyncio.shield(self.policy.ran(verdict, ok=False, output="", error="not run: the turn was stopped"))
            raise
        if unasked is not None:
            await self.policy.ran(verdict, ok=False, output="", error="not run: whether it may run could not be read")
            return unasked
        try:
            ran.execution_id = await self._start_record(call, ctx, verdict.request_id, verdict.args_hash, ran)
        except FencedOut:
            # What the turn runs for was taken away after the check above (the leader failed its step as
            # interrupted, or ended its swarm task; a cancel heard elsewhere): the row was not written and the
            # call never starts.
            if ctx.fence is None:  # a swarm task's worker: its fence travels with the task's scope
                why = "its swarm task was ended elsewhere (cancelled, or interrupted by the leader), so it did not run"
                taken = "not run: its swarm task was ended elsewhere"
                log.warning("agent.task_fenced_out", agent=ctx.agent.name, tool=call.name, task_id=current_scope()[1])
            else:
                why = (
                    "its plan step is no longer this turn's to run (taken away, or waiting for a person),"
                    " so it did not run"
                )
                taken = "not run: its plan step was taken away"
                log.warning("agent.step_fenced_out", agent=ctx.agent.name, tool=call.name,
                            plan=None if ctx.step is None else ctx.step.plan_id,
                            step=None if ctx.step is None else ctx.step.index)  # fmt: skip
            await asyncio.shield(self.policy.ran(verdict, ok=False, output="", error=taken))
            result.tool_runs.append(
                ToolRun(call.name, call.arguments, False, why, refused=True, approval_id=verdict.request_id)
            )
            if ctx.before_tool is not None:
                # The watch reads the step again and stops the turn here when it was taken away; a step only
                # waiting for a person leaves the turn to end with this answer.
                try:
                    await ctx.before_tool()
                except Exception as exc:  # the call is refused all the same
                    count_failure("step_watch")
                    log.warning("agent.step_unread", agent=ctx.agent.name, tool=call.name, error=str(exc))
            fence = ctx.fence or current_fence()
            if fence is not None:
                try:
                    await fence.refused()
                except Exception as exc:  # the call is refused all the same; the watch stops the work later
                    log.warning("agent.fence_stop_failed", agent=ctx.agent.name, tool=call.name, error=str(exc))
            return f"Not run: {why}. End your turn now."
        except Exception as exc:  # nothing runs that is not on disk first
            count_failure("execution_record")
            log.warning("agent.execution_unrecorded", agent=ctx.agent.name, tool=call.name, error=str(exc))
            why = "its start could not be recorded (the store is unavailable), so it did not run; ask again"
            result.tool_runs.append(
                ToolRun(call.name, call.arguments, False, why, refused=True, approval_id=verdict.request_id)
            )
            return f"Not run: {why}."
        note(ran)
        try:
            if failpoints.armed:
                await failpoints.reached("tools.started", lambda: OSError("the tool could not start (failpoint)"))
            outcome = await self.registry.execute(call.name, call.arguments, tool_ctx)
        except asyncio.CancelledError:
            # Stopped mid-run (a deadline, a cancel, a shutdown): it may have run. Said on its row; the stop goes on.
            ran.ended = Ended.INTERRUPTED
            await asyncio.shield(self._finish_record(ran, "stopped mid-run"))
            raise
        except OSError as exc:
            outcome = ToolResult(ok=False, output="", error=f"{call.name} could not start: {exc}")
        ran.ended = Ended.INTERRUPTED if outcome.outcome_unknown else Ended.OK if outcome.ok else Ended.FAILED
        ran.exit_code = outcome.exit_code
        await self._finish_record(ran, "" if outcome.ok else (outcome.error or "failed"))
        await self.policy.ran(verdict, ok=outcome.ok, output=outcome.output, error=outcome.error)
        summary = outcome.output if outcome.ok else (outcome.error or "failed")
        result.tool_runs.append(
            ToolRun(
                call.name,
                call.arguments,
                outcome.ok,
                summary[:500],
                changed_state=outcome.changed_state,
                approval_id=verdict.request_id,
            )
        )
        log.info("agent.tool_ran", agent=ctx.agent.name, tool=call.name, ok=outcome.ok)
        body = cut_for_model(outcome.output, self.registry.output_limit(call.name))
        if not outcome.ok:
            body = f"{outcome.error or 'failed'}\n{body}"
        return fence_untrusted(body, source=f"the {call.name} tool")
