"""Carry out `/swarm …` commands: parse, authorise, run against the swarm service, answer in words."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from datetime import UTC

import structlog

from kazma.approvals.model import Decision
from kazma.config.address import Address
from kazma.config.models import KazmaConfig
from kazma.config.registry import CHAT_PLATFORMS
from kazma.engine.swarm.call_records import CallRecord
from kazma.engine.swarm.endings import ending_lines, execution_of
from kazma.engine.swarm.metrics import swarm_failure
from kazma.engine.swarm.patterns import handoff_paths
from kazma.engine.swarm.roles import authorize
from kazma.engine.swarm.service import SwarmService, request_from
from kazma.engine.swarm.store import StoreUnavailable, TaskRecord
from kazma.engine.swarm.syntax import GrammarError, StartCommand, SwarmCommand
from kazma.engine.swarm.types import SwarmRefused, SwarmRequest, TaskStatus
from kazma.engine.types import tools_line

log = structlog.get_logger("kazma.swarm.commands")

CONFIRM_WINDOW = 300.0
ASK_AGAIN = "again within 5 minutes to run it anew"  # a retry that needs a second send says this (the CLI asks)
_STARTED = re.compile(r"swarm task (?P<id>\S+) started \(|swarm task \S+ retried as (?P<retry>\S+)$")


def started_task(answer: str) -> str | None:
    """The id of the task a command's answer says it started (new work, or a retry), or None."""
    found = _STARTED.match(answer)
    return None if found is None else found.group("id") or found.group("retry")


@dataclass
class SwarmCommands:
    service: SwarmService
    config: KazmaConfig
    # (actor, task) -> asked at: only without a state store (tests); kept there otherwise (see SwarmStateStore)
    _confirm: dict[tuple[str, str], float] = field(default_factory=dict)

    def _now(self) -> float:
        return time.monotonic()

    async def _asked_again(self, actor: str, task_id: str) -> bool:
        state = self.service.state
        if state is not None:
            try:
                return await state.asked_again(actor, task_id, CONFIRM_WINDOW)
            except Exception as exc:  # answered "unavailable … send again": nothing ran, nothing was kept
                swarm_failure("retry_ask")
                raise StoreUnavailable("retry confirmation", str(exc) or type(exc).__name__) from exc
        key = (actor, task_id)
        asked = self._confirm.pop(key, None)
        if asked is not None and self._now() - asked <= CONFIRM_WINDOW:
            return True
        self._confirm[key] = self._now()
        return False

    async def run(self, text: str, *, actor: str, platform: str, chat: str, is_admin: bool, context: str = "") -> str:
        """The answer to one `/swarm` command, always a sentence a person can act on.

        ``context`` (``kazma swarm --context-file``) goes with work the command starts, fenced as data.
        """
        from kazma.engine.swarm.grammar import RetryCommand, parse  # imported by the first /swarm command

        try:
            command = parse(text, workers=self.config.agents.workers, pipelines=self.config.pipelines)
        except GrammarError as exc:
            return str(exc)
        refusal = authorize(command, actor=actor, platform=platform, is_admin=is_admin, config=self.config)
        if refusal is not None:
            log.info("swarm.command_refused", verb=command.verb, actor=actor, platform=platform)
            return refusal.message
        unroutable = _unroutable(command, self.config)
        if unroutable is not None:
            log.info("swarm.route_refused", verb=command.verb, actor=actor, platform=platform)
            return unroutable
        log.info("swarm.command", verb=command.verb, actor=actor, platform=platform)
        try:
            answer = await self._execute(command, actor=actor, platform=platform, chat=chat, context=context)
            if command.route is None or isinstance(command, StartCommand | RetryCommand):
                return answer  # (work's route is where its result goes, when it comes)
            return await self._posted(command.route.conversation, answer)
        except SwarmRefused as exc:
            return f"Not started: {exc}"
        except StoreUnavailable as exc:
            # the person always hears back: a store that cannot answer is said, never swallowed
            log.error("swarm.command_store_unavailable", verb=command.verb, error=str(exc))
            return f"The swarm's task store is unavailable ({exc.operation}); nothing changed, send again."

    async def _posted(self, target: str, answer: str) -> str:
        """A command's answer posted in the chat its route names (help: "to post the result in another chat")."""
        if self.service.deliver is None:
            return f"{answer}\n(not posted to {target}: no platform runs in this process; `kazma run` posts there)"
        try:
            await self.service.deliver(target, answer)
        except Exception as exc:
            swarm_failure("deliver")
            log.warning("swarm.deliver_failed", target=target, error=str(exc))
            return f"{answer}\n(could not be posted to {target}: {exc})"
        return f"Posted to {target}."

    async def _execute(self, command: SwarmCommand, *, actor: str, platform: str, chat: str, context: str) -> str:
        from kazma.engine.swarm import grammar as g  # imported already: run() parsed the command with it

        service = self.service
        route = command.route.conversation if command.route is not None else None
        origin = Address(platform, chat).conversation
        if isinstance(command, g.HelpCommand):
            return g.help_text()
        if isinstance(command, g.StatusCommand):
            if command.task_id is None:
                running = await service.store.count(TaskStatus.RUNNING)
                paused = await service.store.count(TaskStatus.PAUSED)
                return f"swarm: {running} running, {paused} paused, {len(service.workers)} workers"
            record = await service.task(command.task_id)
            calls = await service.store.calls(command.task_id) if record is not None else []
            return _describe(record, command.task_id, calls)
        if isinstance(command, g.TasksCommand):
            if command.worker is None:
                listed = service.as_ended(await service.store.list(limit=20))
                return "\n".join(_line(r) for r in listed) or "no swarm tasks yet"
            found = service.as_ended(await service.store.tasks_of(command.worker, limit=20))
            return "\n".join(_line(r) for r in found) or f"no swarm task named or ran {command.worker}"
        if isinstance(command, g.ListCommand):
            # An ending kept here while the store refused it is laid over its row, as /swarm status does: ended.
            records = service.as_ended(
                [
                    *await service.store.list(TaskStatus.RUNNING, limit=20),
                    *await service.store.list(TaskStatus.PAUSED, limit=20),
                ]
            )
            records = [r for r in records if not r.status.terminal]
            return "\n".join(_line(r) for r in records) or "no running or paused swarm tasks"
        if isinstance(command, g.HistoryCommand):
            return "\n".join(_line(r) for r in await service.store.history(limit=20)) or "no swarm tasks yet"
        if isinstance(command, g.WorkersCommand):
            return "\n".join(service.worker_lines()) or "no workers configured"
        if isinstance(command, g.ConfigCommand):
            swarm = self.config.swarm
            presets = "; ".join(f"{n}: {', '.join(s)}" for n, s in self.config.pipelines.items())
            lines = [
                f"task deadline {swarm.task_deadline_seconds} s, {swarm.max_parallel} tasks at once, "
                f"{swarm.task_concurrency} calls per task, {swarm.max_parallel_workers} calls in the process, "
                f"retention {swarm.retention_days} days, checkpoints {swarm.checkpoints or 'none'}; "
                f"pipelines: {presets}",
                *(f"{name}: {swarm.reliability(name).line()}" for name in self.config.agents.workers),
            ]
            return "\n".join(lines)
        if isinstance(command, g.CancelCommand):
            return await service.cancel(command.task_id, actor=actor)
        if isinstance(command, g.ApproveCommand | g.RejectCommand):
            decision = Decision.APPROVE if isinstance(command, g.ApproveCommand) else Decision.DENY
            return await service.decide_checkpoint(command.task_id, decision, actor=actor, platform=platform)
        if isinstance(command, g.BreakerResetCommand):
            return await service.reset_breaker(command.worker, actor=actor)
        if isinstance(command, g.MetricsCommand):
            return await service.metrics_text(command.days)
        if isinstance(command, g.RetryCommand):
            return await self._retry(command.task_id, actor=actor, origin=origin, route=route)
        request = replace(_request(command, owner=actor, origin=origin, route=route), context=context)
        task_id = await service.submit(request)
        where = f"; the result goes to {route}" if route else ""
        return f"swarm task {task_id} started ({request.pattern}){where}. Check it with /swarm status {task_id}"

    async def _retry(self, task_id: str, *, actor: str, origin: str, route: str | None) -> str:
        record = await self.service.task(task_id)
        if record is None:
            return f"no swarm task {task_id!r}"
        if not record.status.terminal:
            return f"swarm task {task_id} is still {record.status.value}; cancel it first"
        why = _retry_risk(record)
        if why is not None and not await self._asked_again(actor, task_id):
            return f"{why} Send /swarm retry {task_id} {ASK_AGAIN}."
        earlier = request_from(record)
        request = SwarmRequest(
            pattern=earlier.pattern,
            workers=earlier.workers,
            prompt=earlier.prompt,
            owner=actor,
            route=route or earlier.route,
            aggregation=earlier.aggregation,
            preset=earlier.preset,
            conversation=origin,
            routes=earlier.routes,
            expect=earlier.expect,
            deadline_seconds=earlier.deadline_seconds,
            context=earlier.context,
            started_by=actor,
            lineage=earlier.lineage or record.id,
        )
        new_id = await self.service.submit(request)
        return f"swarm task {task_id} retried as {new_id}"


def _unroutable(command: SwarmCommand, config: KazmaConfig) -> str | None:
    """Why ``command``'s route cannot be posted to, or None. A chat platform without its token never runs, and
    the bus drops a post to a platform it does not run with only a log line: a route there answered "Posted to …"
    and a task's result sent there was lost, while the person had been told that is where it goes."""
    if command.route is None:
        return None
    spec = CHAT_PLATFORMS.get(command.route.platform)
    if spec is None or spec.token(config.platforms):
        return None  # the console (web) is served by every `kazma run`
    return (
        f"cannot route to {command.route.conversation}: {command.route.platform} is not configured here "
        f"(platforms.{command.route.platform}.{spec.token_key} is empty), so nothing could be posted there; "
        "nothing was done"
    )


def _retry_risk(record: TaskRecord) -> str | None:
    """Why running ``record`` again needs a second ask, or None: it was interrupted (its outcome unknown), or it
    ended without succeeding after its tools ran or may have run (running it again may do that again)."""
    execution = execution_of(record)
    if record.status is TaskStatus.INTERRUPTED:
        tools = "" if execution is None else f" Its tools: {execution.line()}."
        return f"swarm task {record.id} was interrupted ({record.error}); it may have done part of its work.{tools}"
    if record.status is not TaskStatus.SUCCEEDED and execution is not None and execution.changed_state:
        return (
            f"swarm task {record.id} ended {record.status.value}, and its tools {execution.line()}: running it "
            "again may do that again."
        )
    return None


def _request(command: SwarmCommand, *, owner: str, origin: str, route: str | None) -> SwarmRequest:
    if not isinstance(command, StartCommand):
        raise SwarmRefused(f"/swarm {command.verb} does not start work")
    base = SwarmRequest(
        command.pattern,
        (),
        "",
        owner,
        route,
        conversation=origin,
        expect=command.expect,
        deadline_seconds=command.deadline,
        started_by=owner,
    )
    return replace(base, **command.request_fields())


def _line(record: TaskRecord) -> str:
    when = record.created_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")  # the console shows it in local time
    return f"{record.id}  {record.status.value:<11} {record.pattern:<9} {when}  {record.current_step}"


def _describe(record: TaskRecord | None, task_id: str, calls: list[CallRecord]) -> str:
    if record is None:
        return f"no swarm task {task_id!r}"
    lines = [f"swarm task {record.id}: {record.status.value} ({record.pattern}, by {record.owner})"]
    if record.current_step:
        lines.append(f"step: {record.current_step}")
    if record.error:
        lines.append(f"error: {record.error}")
    details = (record.result or {}).get("details") or {}
    chain = details.get("handoffs") if isinstance(details, dict) else None
    if isinstance(chain, list) and chain:
        paths = handoff_paths([h for h in chain if isinstance(h, dict)])
        lines.append("handoffs: " + "; ".join(" → ".join(path) for path in paths))
    if calls:
        lines.append("steps:")
        lines.extend(call_line(call) for call in calls)
    if record.result and record.result.get("output"):
        lines.append(f"result: {str(record.result['output'])[:1500]}")
    lines.extend(ending_lines(record))
    return "\n".join(lines)


def call_line(call: CallRecord) -> str:
    """One worker call for people: where, who, which model, what tools, how long, how many tokens, how it ended."""
    where = f"{call.step}: " if call.step else ""
    attempt = f" (attempt {call.attempt})" if call.attempt > 1 else ""
    took = "still running or stopped" if call.seconds is None else f"{call.seconds:.1f} s"
    cost = "" if call.cost is None else f", cost {call.cost:.4f}"
    ended = "running" if call.ok is None else "ok" if call.ok else f"failed: {' '.join(call.error.split())[:200]}"
    return (
        f"{call.seq}. {where}{call.worker}{attempt} · model {call.model or '-'} · tools: {tools_line(call.tools)}"
        f" · {took} · {call.prompt_tokens} + {call.completion_tokens} tokens{cost} · {ended}"
    )
