"""Inbound routing and dispatch through the conversation.

A message reaches the agent it addresses (the lead when none). The plan
executor's dispatches are posted into the group *as the lead agent* and the
very same message is then handed to the addressed sub-agent through
:meth:`Conversations.on_inbound` — the path a human @-mention takes. There is
no second channel: the post is the record, and the record is the delivery.

Questions to people (a user step, or a sub-agent's ``ask_user``) are posted
in the conversation naming who may answer; a reply to that message (or a press
of one of its choices) from that person — or a platform admin — answers it.
Nobody else's message does, and neither does whatever is said next.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

import structlog

from kazma.adapters.admission import FileTooLarge
from kazma.adapters.chat_text import Columns
from kazma.adapters.contract import Inbound, PlatformError, Press
from kazma.adapters.human_text import for_humans
from kazma.approvals.model import PressResult, PressVerdict
from kazma.approvals.waiting import WaitingForYou
from kazma.config.address import Address
from kazma.config.backoff import Backoff
from kazma.config.metrics import count_failure
from kazma.config.outgoing import Outgoing
from kazma.config.store.errors import store_errors
from kazma.config.supervisor import Supervisor
from kazma.engine.agent import ASK_USER, AgentRunner, AgentSpec, InternalTool, StepRef, TurnResult, workspace_for
from kazma.engine.attachments import Saved, describe, save_attachments
from kazma.engine.executor import Action, ActionKind, AnswerVerdict, DispatchFailed, PlanExecutor, StepResult
from kazma.engine.fence import fence_untrusted
from kazma.engine.plan import Plan, PlanOrigin
from kazma.engine.plan_store import PlanStore, Question, StepFence
from kazma.engine.plan_tools import ask_user_tool, lead_plan_tools
from kazma.engine.step_watch import STEP_POLL_SECONDS, StepWatch
from kazma.engine.streamed_reply import StreamedReply, stream_at

log = structlog.get_logger("kazma.conversation")

SUMMARY_LIMIT = 1500
SWARM_UNAVAILABLE = "The /swarm commands are not available here: this process runs without the swarm engine."
APPROVALS_UNAVAILABLE = "/approvals is not available here: this process decides no approvals."
FILES_NOT_SAVED = (
    "Kazma could not save the files sent with that message, so nothing was passed on. Please send them again."
)
# The platform refused because of Kazma's setup (Slack without files:read, a refused token): only the operator can
# change it. The platform's own words (scopes, URLs) stay in the log, not in the chat.
FILES_NOT_FETCHABLE = (
    "Kazma could not fetch the files sent with that message, so nothing was passed on. {platform} refused to hand "
    "them over, which sending them again will not change: it is a setup problem for Kazma's operator (Kazma's log "
    "says what to change)."
)
# Refused for good, but not for Kazma's setup (a 404: deleted, or its link expired, before Kazma fetched it):
# that copy is gone, and a new one sent again can be fetched.
FILES_GONE = (
    "Kazma could not fetch the files sent with that message, so nothing was passed on: {platform} no longer hands "
    "them over (most likely they were deleted, or their link expired, before Kazma fetched them). If they are "
    "still wanted, please send them again."
)
QUESTION_PREFIX: Final = "kq1"
WORKING_EVERY: Final = 4.0  # how often the working sign is renewed while a turn runs (adapters rate-limit it)
_QUESTION_BUTTON: Final = re.compile(r"^kq1:(?P<id>[A-Za-z0-9_-]{8,32}):(?P<choice>\d{1,2})$")


class CommandRunner(Protocol):
    """Carries out a ``/swarm …`` command and answers in words (the swarm's commands, injected by ``bot``)."""

    async def run(
        self, text: str, *, actor: str, platform: str, chat: str, is_admin: bool, context: str = ""
    ) -> str: ...


class MessageSink(Protocol):
    async def send(self, to: Address, message: Outgoing) -> str | None:
        """Post ``message`` at ``to``; the message id, or None when it could not be posted."""
        ...


def question_button(question_id: str, choice: int) -> str:
    """``kq1:<question id>:<choice>``: a choice's button data, within Telegram's 64 bytes."""
    return f"{QUESTION_PREFIX}:{question_id}:{choice}"


def is_question_button(data: str) -> bool:
    return data.startswith(QUESTION_PREFIX + ":")


@dataclass(frozen=True)
class _Dispatch:
    plan_id: str
    index: int
    attempt: int
    started_by: str | None = None  # who asked for the plan (its steps' calls are theirs: forbid_requester)


def turn_failed_text(exc: BaseException) -> str:
    """What a person is told of a turn that failed inside Kazma (not the model's or a tool's failure: those are
    the turn's own result)."""
    # The error's own text stays in the log: in a group everyone would read it (paths, statements, addresses).
    return (
        f"Kazma failed while working on this (an internal error, {type(exc).__name__}); nothing more will come of "
        "it. It is logged; please try again."
    )


@dataclass
class Conversations:
    sink: MessageSink
    runner: AgentRunner
    agents: Mapping[str, AgentSpec]
    lead: AgentSpec
    # Where the lead's plans are kept: the conversations carry out their executor's actions, so they make it
    # (None: no plans here).
    plans: PlanStore | None = None
    swarm: CommandRunner | None = None
    waiting: WaitingForYou | None = None  # answers /approvals: what waits for the person asking
    executor: PlanExecutor | None = field(init=False, default=None)
    steps: StepWatch | None = field(init=False, default=None)  # stops a step's turn once it is taken away
    step_poll_seconds: float = STEP_POLL_SECONDS
    _dispatches: dict[tuple[str, str, str], _Dispatch] = field(default_factory=dict)
    _tasks: Supervisor = field(default_factory=lambda: Supervisor("conversation_task"))  # turns in flight
    # told of every executor action after it is carried out (the demo and tests watch plans end)
    listeners: list[Callable[[Action], None]] = field(default_factory=list)
    working_every: float = WORKING_EVERY
    # between posts of a plan's question that did not go out (the platform down): it is posted again until it is
    question_backoff: Backoff = field(default_factory=lambda: Backoff(base=1.0, cap=60.0))

    # -- what people see ---------------------------------------------------------------------------

    async def _say(self, to: Address, text: str, *, agent: str | None = None) -> str | None:
        """Post to people: fences meant for models become a quiet "from @agent" label first."""
        shown = for_humans(text)
        if isinstance(text, Columns):  # a table keeps its fixed-width layout on every platform
            shown = Columns(shown)
        return await self.sink.send(to, Outgoing(shown, agent=agent))

    @contextlib.asynccontextmanager
    async def working(self, at: Address) -> AsyncIterator[None]:
        """While the block runs, the platform shows that an agent is working (when the sink can)."""
        show = getattr(self.sink, "working", None)
        if show is None:
            yield
            return

        async def keep_showing() -> None:
            while True:
                with contextlib.suppress(Exception):
                    await show(at)
                await asyncio.sleep(self.working_every)

        task = asyncio.create_task(keep_showing(), name=f"working-{at.platform}-{at.chat}")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def __post_init__(self) -> None:
        self._plan_tools: dict[str, list[InternalTool]] = {}
        if self.plans is None:
            return
        assignees = {name for name, agent in self.agents.items() if not agent.is_lead}
        executor = self.executor = PlanExecutor(
            self.plans,
            self,
            lead_name=self.lead.name,
            assignees=assignees,
            executions=getattr(self.runner, "executions", None),  # what each step's tools did, from their rows
        )
        self.steps = StepWatch(self.plans, poll_seconds=self.step_poll_seconds)
        asking = ask_user_tool(executor)
        for name, agent in self.agents.items():
            self._plan_tools[name] = lead_plan_tools(executor) if agent.is_lead else [asking]

    def plan_tools(self, agent: str) -> list[InternalTool]:
        """The plan tools ``agent`` has: the lead writes and repairs plans, every other agent may ask people."""
        return self._plan_tools.get(agent, [])

    # -- inbound ---------------------------------------------------------------------------------

    async def on_inbound(self, message: Inbound) -> None:
        """Called by adapters; returns at once so platform acknowledgement windows are kept."""
        self._tasks.spawn(self._handle(message), name=f"inbound-{message.platform}-{message.message_id}")

    async def drain(self) -> None:
        """Wait for every running turn (tests and clean shutdown)."""
        await self._tasks.drain()

    async def stop(self, *, grace: float) -> list[str]:
        """At a clean stop, before the platforms and the store close: the plans' backoff waits end (a wait ending
        later started a turn on a closing store), the turns in flight get ``grace`` seconds to finish (a turn
        whose approval the stop withdrew tells its asker), and the rest are cancelled and waited for. The names
        of the turns cut short. They ran on until the event loop closed, after the store: their record lost."""
        if self.executor is not None:
            await self.executor.stop_waits()
        cut = await self._tasks.stop(grace=grace)
        return sorted(task.get_name() for task in cut)

    async def _handle(self, message: Inbound) -> None:
        try:
            await self._route(message)
        except Exception as exc:
            count_failure("inbound")
            log.exception("inbound.failed", platform=message.platform, chat=message.chat, error=str(exc))
            if message.from_bot:
                return
            # The person is told (they waited for an answer that will not come), never left to silence.
            try:
                await self._say(message.where, turn_failed_text(exc))
            except Exception as told:
                log.warning("inbound.failure_untold", platform=message.platform, chat=message.chat, error=str(told))

    async def _route(self, message: Inbound) -> None:
        conversation = message.where.conversation
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
            await self._say(message.where, reply, agent="swarm")
            return
        if message.command == "plan":
            await self._say(message.where.in_thread(None), await self.describe(conversation), agent=self.lead.name)
            return
        if message.command == "approvals":
            if self.waiting is None:
                reply = APPROVALS_UNAVAILABLE
            else:
                reply = (await self.waiting.for_actor(message.author)).text()
            await self._say(message.where, reply)
            return
        if message.from_bot and dispatch is None:
            # our own posts echoed back by the platform, or another bot: not addressed to us
            return
        if message.reply_to is not None and await self._answer_by_reply(conversation, message):
            return
        worker = next((self.agents[m] for m in message.mentions if m in self.agents and m != self.lead.name), None)
        if dispatch is not None and worker is not None:
            await self._run_step(worker, conversation, message, dispatch)
            return
        agent = worker or self.lead
        text = message.text
        files: tuple[str, ...] = ()
        if message.attachments and not message.from_bot:
            saved = await self._save_files(conversation, message)
            if saved is None:
                return
            files = tuple(s.path for s in saved)
            note = describe(saved)
            text = f"{text}\n\n{note}" if text else note
        log.info("inbound.routed", conversation=conversation, agent=agent.name, author=message.author)
        # shown while the model writes it, where the platform can edit a posted message
        stream = stream_at(self.sink, message.where, agent.name)
        async with self._announcing(agent, conversation):
            try:
                async with self.working(message.where):
                    # a plan written in this turn keeps what the person wrote and the files they sent (PlanOrigin)
                    result = await self.runner.run(
                        agent, conversation, text, requested_by=message.author, files=files,
                        request_text=message.text, stream=stream,
                    )  # fmt: skip
            except BaseException:
                if stream is not None:
                    await asyncio.shield(stream.close())
                raise
            await self._post_result(message, agent, result, stream)

    def _announcing(self, agent: AgentSpec, conversation: str) -> contextlib.AbstractAsyncContextManager[None]:
        """A lead turn: a plan it writes is dispatched only after its reply (which announces the plan) is posted."""
        if agent is not self.lead or self.executor is None:
            return contextlib.nullcontext()
        return self.executor.announcing(conversation)

    async def _save_files(self, conversation: str, message: Inbound) -> list[Saved] | None:
        """Save the message's files into the conversation's workspace; what was saved, or None when they could
        not be saved (the sender is told why, and the agent does not run on half a message)."""
        workspace = workspace_for(self.runner.workspace_root, conversation)
        try:
            saved = await save_attachments(workspace, message.attachments)
        except FileTooLarge as exc:
            await self._say(message.where, str(exc))
            return None
        except (PlatformError, OSError) as exc:
            count_failure("attachment_save", message.platform)
            retryable = not isinstance(exc, PlatformError) or exc.retryable
            setup = isinstance(exc, PlatformError) and exc.operator_must_act
            log.warning(
                "attachments.failed",
                conversation=conversation,
                error=str(exc),
                retryable=retryable,
                operator_must_act=setup,
            )
            # Setup is said even when retryable: no resend helps until the operator changes it.
            text = FILES_NOT_FETCHABLE if setup else FILES_NOT_SAVED if retryable else FILES_GONE
            await self._say(message.where, text.format(platform=message.platform.title()))
            return None
        return saved

    async def describe(self, conversation: str) -> str:
        if self.executor is None:
            return "Plans are not available here."
        return await self.executor.describe(conversation)

    @contextlib.asynccontextmanager
    async def _step_turn(self, step: StepRef, agent: AgentSpec, where: Address) -> AsyncIterator[list[bool]]:
        """Around a plan step's turn: it is stopped once the step is taken away from it (failed elsewhere as
        interrupted, run again), said once in the conversation. The list it gives holds True once that happened:
        the turn's result then belongs to nobody and is not recorded."""
        stopped: list[bool] = []
        if self.steps is None:
            yield stopped
            return
        try:
            with self.steps.watching(step):
                yield stopped
        except asyncio.CancelledError:
            reason = self.steps.taken(step)
            if reason is None:
                raise
            ours = self.steps.forget(step)
            stopped.append(True)
            log.warning("plan.step_turn_stopped", plan=step.plan_id, step=step.index, attempt=step.attempt,
                        agent=agent.name, reason=reason)  # fmt: skip
            await asyncio.shield(
                self._say(
                    where,
                    f"@{agent.name} stopped working on step {step.index} here (attempt {step.attempt}): {reason}. "
                    "None of its tools runs from now on; what it did so far is in its tools' records.",
                    agent=agent.name,
                )
            )
            task = asyncio.current_task()
            assert task is not None
            for _ in range(ours):
                task.uncancel()
            if task.cancelling():
                raise  # cancelled for another reason too (a shutdown): that goes on
        else:
            # Stopped, and the cancellation swallowed on its way out (its tools were refused all the same): the
            # result is still nobody's.
            if self.steps.taken(step) is not None:
                stopped.append(True)
                self.steps.forget(step)

    def _fence(self, step: StepRef) -> StepFence | None:
        """What a tool of ``step``'s turn starts under: the step still this turn's (see :class:`StepFence`)."""
        return None if self.plans is None else self.plans.fence(step.plan_id, step.index, step.attempt)

    async def _run_step(self, worker: AgentSpec, conversation: str, message: Inbound, dispatch: _Dispatch) -> None:
        step = StepRef(dispatch.plan_id, dispatch.index, dispatch.attempt)
        check = None if self.steps is None else self.steps.check
        try:
            async with self._step_turn(step, worker, message.where) as stopped, self.working(message.where):
                result = await self.runner.run(
                    worker, conversation, message.text, requested_by=message.author, step=step,
                    started_by=dispatch.started_by,
                    before_tool=None if check is None else functools.partial(check, step),
                    fence=self._fence(step),
                )  # fmt: skip
            if stopped:
                return
        except Exception as exc:
            # The step ends failed (not transient: its tools may have run), so its plan goes on to the lead's
            # decision instead of holding the step in progress until a restart.
            count_failure("step_turn")
            log.exception("plan.step_turn_failed", plan=dispatch.plan_id, step=dispatch.index, error=str(exc))
            result = TurnResult(text="", error=turn_failed_text(exc))
        transient = result.transient and not result.changed_state
        if self.executor is None or not self.executor.will_retry(transient, dispatch.attempt):
            # A failure the step is retried after is said once, with when it runs again, by the executor's notice:
            # each attempt's "I could not finish" repeated the same words in the chat.
            await self._post_result(message, worker, result)
        if self.executor is None:
            return
        outcome = StepResult(
            ok=result.ok,
            summary=result.text[:SUMMARY_LIMIT],
            files=result.files_written,
            error=result.error or "",
            transient=transient,
            retry_after=result.retry_after,
            model=result.model,
            tools=result.tools,
            usage=result.usage,
            execution=result.execution,
        )
        if any(run.name == ASK_USER and run.ok for run in result.tool_runs):
            # The turn asked a person: the step waits, and the turn resumed with the answer completes it. An answer
            # given before this turn ended has resumed the step already (the same attempt): this turn's closing line
            # would have been taken as the step's result, and the next step started while the resumed one ran.
            return
        await self.executor.complete(dispatch.plan_id, dispatch.index, outcome, attempt=dispatch.attempt)

    async def _post_result(
        self, message: Inbound, agent: AgentSpec, result: TurnResult, stream: StreamedReply | None = None
    ) -> None:
        text = result.text if result.ok else f"I could not finish: {result.error}"
        if stream is not None and text:
            await stream.finish(text)
        elif stream is not None:
            await stream.close()
        elif text:
            await self._say(message.where, text, agent=agent.name)

    # -- answers to questions --------------------------------------------------------------------

    async def _answer_by_reply(self, conversation: str, message: Inbound) -> bool:
        """A reply to an open question's message answers it — if it comes from who may answer. True: handled."""
        if self.executor is None:
            return False
        question = next(
            (q for q in await self.executor.open_questions(conversation) if q.message_id == message.reply_to),
            None,
        )
        if question is None:
            return False
        if question.choices and message.text.strip() not in question.choices:
            await self._say(
                message.where.in_thread(None),
                f"Please answer with one of: {', '.join(question.choices)} (or press its button).",
                agent=self.lead.name,
            )
            return True
        result = await self.executor.answer(question.id, message.text, actor=message.author, is_admin=message.is_admin)
        if result.verdict is AnswerVerdict.REFUSED:
            # Someone else replying to the question is talk, not an answer: ignored, and said nowhere in chat.
            log.info("plan.reply_ignored", question=question.id, author=message.author)
            return True
        if result.verdict is AnswerVerdict.LOST:
            await self._say(message.where.in_thread(None), result.message, agent=self.lead.name)
        return True

    async def answer_press(self, press: Press, *, is_admin: bool = False) -> PressResult:
        """A press of one of a question's choice buttons."""
        match = _QUESTION_BUTTON.fullmatch(press.data)
        if match is None or self.executor is None:
            return PressResult(PressVerdict.REFUSED, "This button is not valid; nothing was recorded.")
        question = await self.executor.store.question(match["id"])
        choice = int(match["choice"])
        if question is None or choice >= len(question.choices):
            return PressResult(PressVerdict.REFUSED, "This button is not valid; nothing was recorded.")
        result = await self.executor.answer(question.id, question.choices[choice], actor=press.actor, is_admin=is_admin)
        verdict = {
            AnswerVerdict.TAKEN: PressVerdict.WON,
            AnswerVerdict.LOST: PressVerdict.LOST,
            AnswerVerdict.REFUSED: PressVerdict.REFUSED,
        }[result.verdict]
        return PressResult(verdict, result.message)

    # -- Dispatcher (the executor's hands) --------------------------------------------------------

    async def perform(self, action: Action) -> None:
        await self._perform(action)
        for listener in self.listeners:
            listener(action)

    async def _perform(self, action: Action) -> None:
        where = Address.parse(action.plan.conversation)
        step = action.step
        if action.kind in (ActionKind.DISPATCH, ActionKind.RESUME):
            assert step is not None
            await self._dispatch(action, step.spec.assignee, step.index, step.attempts)
        elif action.kind is ActionKind.ASK_USER:
            assert action.question is not None
            await self._ask(where, action.question)
        elif action.kind is ActionKind.NOTICE:
            await self._say(where, action.text, agent=self.lead.name)
        elif action.kind is ActionKind.RUN_LEAD:
            assert step is not None
            self._tasks.spawn(self._lead_step(action), name=f"lead-step-{action.plan.id}-{step.index}")
        elif action.kind is ActionKind.ASK_LEAD:
            assert step is not None
            prompt = (
                f"{action.text}\nDecide what to do next and tell the team: retry_step (optionally with new input), "
                "replace_steps, skip_step or abort_plan. If you do none of them, the steps that need this one are "
                "dropped and the rest of the plan goes on."
            )
            self._tasks.spawn(
                self._ask_lead(action.plan, step.index, step.attempts, prompt), name=f"ask-lead-{action.plan.id}"
            )
        elif action.kind is ActionKind.FINISHED:
            summaries = "\n".join(
                f"Step {s.index} ({s.spec.assignee}, {s.status.value}): "
                + fence_untrusted(s.output_summary or s.failure_reason or "-", source=f"step {s.index}")
                for s in action.plan.steps.values()
            )
            prompt = f"The plan for '{action.plan.goal}' has finished. Report the result to the team.\n{summaries}"
            self._tasks.spawn(
                self._lead_says(action.plan.conversation, prompt, origin=action.plan.origin),
                name=f"finish-{action.plan.id}",
            )

    async def _dispatch(self, action: Action, assignee: str, index: int, attempt: int) -> None:
        where = Address.parse(action.plan.conversation)
        platform, chat = where.platform, where.chat
        known = self.agents.get(assignee)
        if known is None or known.is_lead:
            # A plan outlives its configuration (a restart without that worker, the lead renamed): a post nobody
            # can take up ran the lead on it as if it had asked, and the step stayed in progress for good.
            workers = ", ".join(sorted(name for name, agent in self.agents.items() if not agent.is_lead)) or "none"
            raise DispatchFailed(
                f"there is no agent named {assignee!r} in this configuration (workers: {workers})", transient=False
            )
        # The note ("(try 2 of 3)") sits beside the same mention: people see a retry for what it is,
        # and the sub-agent is still the one addressed.
        text = " ".join(part for part in (f"@{assignee}", action.note, action.text) if part).rstrip()
        message_id = await self._say(where, text, agent=self.lead.name)
        if message_id is None:
            raise DispatchFailed(f"the dispatch to @{assignee} could not be posted", transient=True)
        self._dispatches[(platform, chat, message_id)] = _Dispatch(
            action.plan.id, index, attempt, started_by=action.plan.origin.started_by
        )
        inbound = Inbound(
            platform=platform,
            chat=chat,
            message_id=message_id,
            author=f"agent:{self.lead.name}",
            author_name=self.lead.name,
            text=text,
            mentions=(assignee,),
            from_bot=True,
        )
        log.info("plan.dispatched", plan_id=action.plan.id, step=index, to=assignee, kind=action.kind.value)
        await self.on_inbound(inbound)  # the same message, through the same inbound path

    async def _ask(self, where: Address, question: Question) -> None:
        assert self.executor is not None
        who = question.answerer.removesuffix(":admins")
        if question.choices:
            how = "Press one of the buttons, or reply to this message with one of the choices."
        else:
            how = "Reply to this message to answer."
        text = f"Question from @{question.asked_by} for {who} (or an admin):\n{question.question}\n{how}"
        choices = [(label, question_button(question.id, i)) for i, label in enumerate(question.choices)]
        asked = Outgoing.question(for_humans(text), choices, agent=self.lead.name)
        message_id = await self.sink.send(where, asked)
        if message_id is None:
            count_failure("question_post")
            log.warning("plan.question_not_posted", question=question.id, conversation=question.conversation)
            # Nobody can answer a question nobody saw, and the plan waits for it: posted again (backing off)
            # while it is still open. It waited for ever (until a restart showed it again).
            self._tasks.spawn(self._ask_again(where, question, asked), name=f"question-{question.id}")
            return
        try:
            await self.executor.question_posted(question.id, message_id)
        except store_errors() as exc:
            # Shown but not recorded: a reply to it would not be taken for its answer. Recorded again (backing
            # off), never posted a second time.
            count_failure("question_post")
            log.warning("plan.question_post_unrecorded", question=question.id, error=str(exc))
            self._tasks.spawn(
                self._ask_again(where, question, asked, posted=message_id), name=f"question-{question.id}"
            )

    async def _ask_again(
        self, where: Address, question: Question, asked: Outgoing, *, posted: str | None = None
    ) -> None:
        """Post an open question nobody saw (or record the post of one, ``posted``: its message id) until it is
        shown and recorded, or answered, withdrawn, posted by another path meanwhile. A store that fails is one
        more try after the one backoff: the task ended in the store's error, and the question stayed unseen
        until a restart."""
        assert self.executor is not None
        retry = 0
        while True:
            await asyncio.sleep(self.question_backoff.delay(retry))
            retry += 1
            try:
                if posted is None:
                    still = await self.executor.store.question(question.id)
                    if still is None or still.status != "pending" or still.message_id is not None:
                        return
                    posted = await self.sink.send(where, asked)
                    if posted is None:
                        count_failure("question_post")
                        continue
                await self.executor.question_posted(question.id, posted)
            except store_errors() as exc:
                count_failure("question_post")
                log.warning("plan.question_repost_failed", question=question.id, attempts=retry, error=str(exc))
                continue
            log.info("plan.question_posted_late", question=question.id, attempts=retry + 1)
            return

    async def _lead_step(self, action: Action) -> None:
        assert action.step is not None
        assert self.executor is not None
        step = StepRef(action.plan.id, action.step.index, action.step.attempts)
        check = None if self.steps is None else self.steps.check
        try:
            async with self._step_turn(step, self.lead, Address.parse(action.plan.conversation)) as stopped:
                result = await self.runner.run(
                    self.lead,
                    action.plan.conversation,
                    action.text or action.step.spec.title,
                    requested_by="executor",
                    step=step,
                    started_by=action.plan.origin.started_by,
                    before_tool=None if check is None else functools.partial(check, step),
                    fence=self._fence(step),
                )
            if stopped:
                return
        except Exception as exc:
            # As a sub-agent's step (see _run_step): the lead's own step ends failed, so the lead decides about it;
            # escaping, it reached only the task's log, and the step stayed in progress until a restart.
            count_failure("step_turn")
            log.exception("plan.step_turn_failed", plan=action.plan.id, step=action.step.index, error=str(exc))
            result = TurnResult(text="", error=turn_failed_text(exc))
        await self.executor.complete(
            action.plan.id,
            action.step.index,
            StepResult(
                ok=result.ok,
                summary=result.text[:SUMMARY_LIMIT],
                files=result.files_written,
                error=result.error or "",
                model=result.model,
                tools=result.tools,
                usage=result.usage,
                execution=result.execution,
            ),
            attempt=action.step.attempts,
        )

    async def _ask_lead(self, plan: Plan, index: int, attempt: int, prompt: str) -> None:
        try:
            await self._lead_says(plan.conversation, prompt, origin=plan.origin)
        finally:
            if self.executor is not None:
                await self.executor.lead_decided(plan.id, index, attempt)

    async def _lead_says(self, conversation: str, prompt: str, *, origin: PlanOrigin | None = None) -> None:
        """A lead turn the executor asks for about a plan (a failure, the report). ``origin``: that plan's; a plan
        the lead writes in the turn keeps it (the person's words and files, and who asked: whom forbid_requester
        refuses and who may answer its questions), not "executor" and the executor's prompt."""
        where = Address.parse(conversation)
        async with self._announcing(self.lead, conversation):
            try:
                async with self.working(where):
                    result = await self.runner.run(
                        self.lead,
                        conversation,
                        prompt,
                        requested_by="executor",
                        started_by=None if origin is None else origin.started_by,
                        request_text=None if origin is None else origin.text,
                        files=() if origin is None else origin.files,
                    )
            except Exception as exc:
                # As a person's own turn (see _handle): nobody asked in chat, but the plan is theirs, and a turn
                # deciding about a failed step that breaks gives the step up: they are told, never left to silence.
                count_failure("lead_turn")
                log.exception("plan.lead_turn_failed", conversation=conversation, error=str(exc))
                await self._say(where, turn_failed_text(exc), agent=self.lead.name)
                return
            text = result.text if result.ok else f"I could not finish: {result.error}"
            if text:
                await self._say(where, text, agent=self.lead.name)
