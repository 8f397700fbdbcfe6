"""The composition root: store, approvals, platforms, bus, agents and the plan executor, wired together."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
from collections.abc import Collection, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from kazma.adapters.admission import DirectPolicy, FileBounds
from kazma.adapters.bus import SAFETY_SCAN_SECONDS, FanOutBus, NullBus
from kazma.adapters.contract import ChatMove, Handlers, Inbound, PlatformAdapter, Press
from kazma.adapters.outbox import Outbox
from kazma.adapters.pacing import ChatRateLimiter
from kazma.adapters.web import WebAdapter
from kazma.approvals import ApprovalService, ApprovalStore, PressResult, SafetyPolicy
from kazma.approvals.rules import RuleStore
from kazma.approvals.service import Recovery
from kazma.bot.api_store import IdempotencyKeys
from kazma.bot.chat_moves import ChatMoves
from kazma.bot.inbound_claims import InboundClaims
from kazma.bot.keys import decision_keys_folder, load_decision_keyring
from kazma.bot.store import StoreWatch
from kazma.bot.store_handles import StoreHandles, open_handles
from kazma.config import LoadedConfig, enabled_platforms
from kazma.config.backoff import Backoff
from kazma.config.metrics import count_failure
from kazma.config.registry import CHAT_PLATFORMS
from kazma.engine.agent import AgentRunner, agents_from_config
from kazma.engine.conversation import Conversations, is_question_button
from kazma.engine.executor import Action, PlanExecutor
from kazma.engine.history import HistoryStore
from kazma.engine.model_router import provider_for
from kazma.engine.plan_store import PlanStore
from kazma.engine.swarm import model_calls
from kazma.engine.swarm.commands import SwarmCommands
from kazma.engine.swarm.lead_tools import swarm_tools
from kazma.engine.swarm.routing import EmbeddingRouter
from kazma.engine.swarm.service import CoalescingReporter, SwarmService
from kazma.engine.swarm.state_store import SwarmStateStore
from kazma.engine.swarm.store import SwarmTaskStore
from kazma.engine.swarm.workers import AgentWorker
from kazma.engine.tools.builtin import default_registry
from kazma.engine.tools.executions import ExecutionRecord
from kazma.engine.tools.mcp_launch import places_for
from kazma.engine.tools.mcp_tools import MCPSources
from kazma.engine.tools.registry import ToolRegistry
from kazma.engine.tools.sandbox import resolve_sandbox
from kazma.engine.tools.send_file import SendFileTool
from kazma.engine.transcript import RecordingSink, TranscriptStore
from kazma.engine.types import ModelProvider

if TYPE_CHECKING:
    from kazma.bot.replication import Replication

log = structlog.get_logger("kazma.app")

# A leader's singleton ingress that failed to open is tried again this often; an open one is checked this often.
INGRESS_RETRY = Backoff(base=1.0, cap=30.0)
INGRESS_CHECK_SECONDS = 10.0


def build_adapters(loaded: LoadedConfig, *, paced: bool = True) -> list[PlatformAdapter]:
    """One adapter per platform with a token, built from the registry. Imported lazily: each library is heavy.

    ``paced=False`` (``kazma run --no-pacing``, for wire-level fakes that enforce no limits): no per-chat
    gaps between sends, so a test can post a hundred cards into one chat in seconds. Never against a platform.
    """
    config = loaded.config
    platforms = config.platforms
    files = FileBounds(max_bytes=config.files.max_bytes, max_count=config.files.max_count)
    adapters: list[PlatformAdapter] = []
    for name in enabled_platforms(loaded):
        spec = CHAT_PLATFORMS[name]
        module, _, attribute = spec.adapter.partition(":")
        factory = getattr(importlib.import_module(module), attribute)
        section = spec.section(platforms)
        # "approvers" in dm_policy: the approvers written for this platform and its admins, as for cards
        direct = DirectPolicy.of(getattr(section, "dm_policy", "off"), config.roster.approvers_for(name))
        extra: dict[str, object] = {}
        if not paced and "limiter" in inspect.signature(factory).parameters:
            extra["limiter"] = ChatRateLimiter(min_interval=0.0)
        adapters.append(
            factory(section, approve_partial=config.approvals.approve_cut_in_chat, direct=direct, files=files, **extra)
        )
    return adapters


@dataclass
class App:
    loaded: LoadedConfig
    stores: StoreHandles
    service: ApprovalService
    policy: SafetyPolicy
    bus: FanOutBus | NullBus
    conversations: Conversations
    executor: PlanExecutor
    provider: ModelProvider
    swarm: SwarmService
    chat_moves: ChatMoves
    transcript: TranscriptStore
    sweep_interval: float = 5.0
    store_watch: StoreWatch | None = None
    mcp: MCPSources | None = None
    replica: str = "local"
    inbound_claims: InboundClaims | None = None
    # Signed requests seen (Slack's replay guard), in the store on either backend; the claims table holds them.
    signed_requests: InboundClaims | None = None
    # Several replicas on one PostgreSQL database: this one's lease and wake-ups (None on SQLite).
    replication: Replication | None = None
    # The approvals API's idempotency keys, swept with the other retention (None: not swept here).
    api_keys: IdempotencyKeys | None = None
    # Every tool execution's row (None: not recorded here); rows a dead process left running end "lost" at start.
    executions: ExecutionRecord | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _leader_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _live: set[str] = field(default_factory=set)  # the replicas alive at the leader's last look
    _recovery_due: bool = False  # the leader has yet to judge what gone replicas left
    _serving: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_press(self, press: Press) -> PressResult:
        if is_question_button(press.data):
            return await self.conversations.answer_press(press, is_admin=press.is_admin)
        return await self.service.decide_from_button(
            press.data, actor=press.actor, platform=press.platform, chat=press.chat, message_id=press.message_id
        )

    async def on_inbound(self, message: Inbound) -> None:
        if not message.from_bot:  # our own posts come back on some platforms; they were kept when sent
            await self._keep(message)
        await self.conversations.on_inbound(message)

    async def _keep(self, message: Inbound) -> None:
        """What people say, kept for the console (commands and files included) before it is handled."""
        text = f"/{message.command} {message.text}".rstrip() if message.command else message.text
        if message.attachments:
            names = ", ".join(a.name for a in message.attachments)
            text = f"{text}\n[files: {names}]" if text else f"[files: {names}]"
        try:
            await self.transcript.record(
                message.platform,
                message.chat,
                author=message.author,
                name=message.author_name or message.author,
                text=text,
                direction="in",
                message_id=message.message_id,
                direct=message.direct,
            )
        except Exception as exc:
            count_failure("transcript")
            log.warning("transcript.record_failed", platform=message.platform, chat=message.chat, error=str(exc))

    @property
    def handlers(self) -> Handlers:
        return Handlers(
            on_inbound=self.on_inbound,
            on_press=self.on_press,
            on_chat_moved=self.on_chat_moved,
            # Among replicas, each inbound event is handled by the first to claim it (a new leader is sent
            # again what the old one fetched but never confirmed). One process on SQLite has nobody to race.
            claim_inbound=None if self.inbound_claims is None else self.inbound_claims.claim,
            inbound_done=None if self.inbound_claims is None else self.inbound_claims.done,
            inbox=self.inbound_claims,
            first_signed=None if self.signed_requests is None else self.signed_requests.first_signed,
        )

    async def start(self) -> None:
        log.info("app.model", provider=self.provider.label)
        if self.replication is not None:
            await self._start_replica(self.replication)
            return
        # Recover before any platform can start new work: a task or step started by
        # this process must never be mistaken for one a dead process left running.
        await self._executions_lost(None)  # first: the endings below say what may have run
        interrupted, tell_lead = await self.executor.mark_interrupted()
        if interrupted:
            log.warning("app.steps_interrupted", steps=[f"{p}#{i}" for p, i in interrupted])
        await self.swarm.recover()  # its reports are coalesced and sent once the platforms are up
        recovery = await self.service.recover()  # orphans end before anyone can press their stale buttons
        self._tasks.append(asyncio.create_task(self._retention(), name="kazma-swarm-retention"))
        await self._follow_chat_moves()
        if self.mcp is not None:  # tools listed before the first turn when the servers are quick; later otherwise
            await self.mcp.start(wait=10.0)
        await self.bus.start(self.handlers)
        await self._tell(recovery)
        await self.executor.perform(tell_lead)
        self._tasks.append(asyncio.create_task(self._sweep(), name="kazma-approvals-sweep"))
        store_path = self.loaded.config.store.path
        if str(store_path) != ":memory:" and store_path.exists():
            self.store_watch = StoreWatch(store_path, self._store_lost)
            self._tasks.append(asyncio.create_task(self.store_watch.run(), name="kazma-store-watch"))
        log.info("app.started", platforms=sorted(self.bus.adapters), store=str(self.loaded.config.store.path))

    async def _start_replica(self, replication: Replication) -> None:
        """One of several replicas: visible to the others first, then what its previous life left, then serve.
        The sweeps and the singleton ingress wait for the lease (:meth:`_lead`)."""
        from kazma.bot.replication import AllBut

        # Its name goes on what it starts from now on: the others tell from its lease session whether it lives.
        self.service.store.replica = self.replica
        self.executor.store.replica = self.replica
        self.swarm.store.replica = self.replica
        if self.executions is not None:
            self.executions.replica = self.replica
        await replication.start()  # its lease session is up: no leader takes what it starts for a dead one's
        # What this replica's previous life (same name) left: the others may never have seen it gone.
        await self.swarm.restore_breakers()
        told = await self._recover_replicas(AllBut(self.replica), claims=False)
        await self._follow_chat_moves()
        if self.mcp is not None:
            await self.mcp.start(wait=10.0)
        await self.bus.start(self.handlers, ingress=False)  # the leader's own, opened with the lease
        self._serving.set()
        self._spawn(self._say(*told), "kazma-recovery-notices")
        log.info("app.started", platforms=sorted(self.bus.adapters), store="postgresql", replica=self.replica)

    async def _lead(self) -> None:
        """This replica took the lease: open the singleton ingress and run the sweeps at once; the sweep judges
        what gone replicas left (once they have been missing long enough to be sure) and retries until done."""
        await self._serving.wait()  # the lease may come before this replica serves
        self._recovery_due = True
        self._leader_tasks.append(asyncio.create_task(self._keep_ingress(), name="kazma-leader-ingress"))
        self._leader_tasks.append(asyncio.create_task(self._sweep(), name="kazma-approvals-sweep"))
        self._leader_tasks.append(asyncio.create_task(self._retention(), name="kazma-swarm-retention"))

    async def _keep_ingress(self) -> None:
        """While leading: every singleton ingress open, one that failed to open tried again with backoff."""
        if not isinstance(self.bus, FanOutBus):
            return
        failures = 0
        while True:
            await self.bus.start_ingress()
            missing = self.bus.ingress_missing()
            failures = failures + 1 if missing else 0
            if missing:
                log.warning("app.ingress_retry", platforms=missing, attempt=failures)
            await asyncio.sleep(INGRESS_RETRY.delay(failures - 1) if missing else INGRESS_CHECK_SECONDS)

    async def _recover_replicas(self, live: Collection[str], *, claims: bool = True) -> tuple[Recovery, list[Action]]:
        """End what replicas not in ``live`` left running: pending requests, plan steps, swarm tasks (and
        release their post and edit claims); what to tell people and the lead is returned, not said."""
        replication = self.replication
        assert replication is not None
        await self._executions_lost(live)
        interrupted, tell_lead = await self.executor.mark_interrupted(live)
        if interrupted:
            log.warning("app.steps_interrupted", steps=[f"{p}#{i}" for p, i in interrupted])
        await self.swarm.recover_gone(live)
        if claims:
            recovery = await replication.recover_gone(set(live))
        else:
            recovery = await self.service.recover(live)
        return recovery, tell_lead

    async def _executions_lost(self, live: Collection[str] | None) -> None:
        """Executions a process that is gone left running end "lost": they may have run, and every ending that
        names them says so."""
        if self.executions is None:
            return
        try:
            await self.executions.mark_lost(live)
        except Exception as exc:  # they still read "started, not finished"; the next start marks them
            count_failure("execution_record")
            log.warning("app.executions_unmarked", error=str(exc))

    async def _say(self, recovery: Recovery, tell_lead: list[Action]) -> None:
        """Recovery's notices, in the background: a paced platform must not hold up the sweeps or the ingress."""
        try:
            await self._tell(recovery)
            await self.executor.perform(tell_lead)
        except Exception as exc:
            count_failure("recovery_notice")
            log.warning("app.recovery_notice_failed", error=str(exc))

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.append(task)
        task.add_done_callback(lambda done: self._tasks.remove(done) if done in self._tasks else None)

    async def _follow(self, reason: str) -> None:
        """The lease is gone (another replica leads, or the database cannot be reached): stop the sweeps."""
        tasks, self._leader_tasks = self._leader_tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.replication is not None and isinstance(self.bus, FanOutBus):
            await self.bus.stop_ingress()  # another replica may be opening them already

    async def _tell(self, recovery: Recovery) -> None:
        for conversation, text in recovery.messages():
            platform, _, chat = conversation.partition(":")
            await self.bus.send_text(platform, chat, text, agent=self.conversations.lead.name)

    async def _follow_chat_moves(self) -> None:
        """Chats that moved before this start (kazma.yaml may still name the old id): serve the new one."""
        adapters: dict[str, object] = getattr(self.bus, "adapters", {})
        for move in await self.chat_moves.all():
            follow = getattr(adapters.get(move.platform), "follow_move", None)
            if follow is not None and follow(move.old, move.new) is not None:
                log.warning("chat.move_followed", platform=move.platform, old=move.old, new=move.new)

    async def on_chat_moved(self, move: ChatMove) -> None:
        """A platform moved a served chat (a Telegram group became a supergroup): keep it, and say what to edit."""
        if not await self.chat_moves.record(move):
            return
        lines = config_lines_for_move(self.loaded, move)
        log.warning(
            "chat.moved",
            platform=move.platform,
            old=move.old,
            new=move.new,
            update_config=lines,
            detail="followed now and after restarts; update kazma.yaml",
        )
        where = " and ".join(f"`{line}`" for line in lines) or "nothing (it was served as one of every chat)"
        text = (
            f"This chat's {move.platform.title()} id changed from {move.old} to {move.new} (the group became a "
            f"supergroup). Kazma follows it, also after a restart. In kazma.yaml, set {where}."
        )
        try:
            await self.bus.send_text(move.platform, move.new, text, agent=self.conversations.lead.name)
        except Exception as exc:  # recorded and logged already; a chat that refuses the notice changes nothing
            log.warning("chat.move_not_announced", platform=move.platform, chat=move.new, error=str(exc))

    async def _store_lost(self, reason: str) -> None:
        """Stop deciding, and say why wherever people are: a decision now would be written nowhere."""
        self.service.halt(reason)
        await self.bus.broadcast(
            f"Kazma has stopped deciding approvals: {reason}. Restart Kazma with its store in place.",
            agent=self.conversations.lead.name,
        )

    async def _sweep(self) -> None:
        """End requests whose waiter died with an earlier process (or, among replicas, with a replica that is
        gone), or whose polling asker stopped asking, so their cards settle too."""
        while True:
            try:
                for outcome in await self.service.expire_overdue():
                    log.info("approvals.swept", request_id=outcome.request_id, status=outcome.status.value)
                await self.service.withdraw_silent()  # polling askers gone quiet (a script killed mid-wait)
                await self.swarm.sweep_checkpoints()  # a checkpoint card whose task is not paused at it
                if self.replication is not None:
                    await self._judge_replicas(self.replication)
            except Exception as exc:
                count_failure("approval_sweep")
                log.warning("approvals.sweep_failed", error=str(exc))
            await asyncio.sleep(self.sweep_interval)

    async def _judge_replicas(self, replication: Replication) -> None:
        """What a replica that left ran ends now: at takeover, when one goes missing for good, after a failure."""
        live = await replication.settled_live()
        if live is None:
            return  # looked for too short a time: one missing now may only be reconnecting
        if self._recovery_due or self._live - live:
            self._spawn(self._say(*await self._recover_replicas(live)), "kazma-recovery-notices")
            self._recovery_due = False  # done: only now (a failure above leaves it due for the next sweep)
        self._live = live

    async def _retention(self) -> None:
        """Swarm tasks older than ``swarm.retention_days`` go at start and then every sweep (0 keeps all);
        inbound claims and signed requests older than a day too (no platform delivers an event again after
        that, and Slack refuses a signature after five minutes), and the approvals API's idempotency keys a
        day past their request's deadline."""
        while True:
            await self.swarm.sweep_retention()
            if self.signed_requests is not None:  # the same table as the replicas' inbound claims
                try:
                    await self.signed_requests.forget_older_than()
                except Exception as exc:
                    log.warning("inbound.claims_sweep_failed", error=str(exc))
            if self.api_keys is not None:  # a day past their request's deadline (bot/api_store.py)
                try:
                    forgotten = await self.api_keys.forget_expired()
                    if forgotten:
                        log.info("api.keys_swept", keys=forgotten)
                except Exception as exc:
                    log.warning("api.keys_sweep_failed", error=str(exc))
            await asyncio.sleep(self.loaded.config.swarm.retention_sweep_seconds)

    async def stop(self) -> None:
        if self.replication is not None:
            await self.replication.stop()  # the lease first: another replica takes the duties at once
        await self._follow("stopping")
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.swarm.close()
        if self.mcp is not None:
            await self.mcp.stop()
        await self.bus.stop()
        closer = getattr(self.provider, "aclose", None)
        if closer is not None:
            await closer()
        await self.stores.close()
        log.info("app.stopped")


async def build_app(
    loaded: LoadedConfig,
    *,
    poll_interval: float = SAFETY_SCAN_SECONDS,
    provider: ModelProvider | None = None,
    adapters: list[PlatformAdapter] | None = None,
    registry: ToolRegistry | None = None,
    workspace_root: Path | None = None,
    web: WebAdapter | None = None,
    paced: bool = True,
) -> App:
    config = loaded.config
    shared = config.store.backend == "postgresql"
    replica = "local"
    if shared:  # psycopg and the lease machinery are imported only by replicas
        from kazma.bot.replication import replica_name

        replica = replica_name()
    stores = await open_handles(config, replica=replica)
    # The owner of the requests it opens once it serves as a replica (App.start): a command that only builds
    # the app (`kazma swarm`) holds no lease, so nobody could tell whether it is alive.
    try:
        keyring = load_decision_keyring(config)  # seals every outcome; made at first start on SQLite
    except BaseException:
        await stores.close()
        raise
    store = ApprovalStore(stores.primary, keyring=keyring)
    platform_adapters = build_adapters(loaded, paced=paced) if adapters is None else list(adapters)
    if web is not None:
        platform_adapters.append(web)
    bus: FanOutBus | NullBus
    outbox = Outbox(stores.outbox, replica=replica)
    if platform_adapters:
        bus = FanOutBus(
            platform_adapters, store=store, outbox=outbox, config=config, poll_interval=poll_interval, shared=shared
        )
    else:
        bus = NullBus()
    # Among replicas a decision made elsewhere wakes the waiter by NOTIFY: its own reads are only a safety net.
    service = ApprovalService(
        store, config, publisher=bus, rules=RuleStore(stores.primary), poll_interval=30.0 if shared else 0.5
    )
    policy = SafetyPolicy(service)
    model = provider or provider_for(config)
    state = config.store.path.parent
    tools = registry or default_registry(
        sandbox=resolve_sandbox(config.tools.sandbox),
        shell_network=config.tools.shell_network,
        # The store, the tokens, the sessions, the decision keys: never visible to a command.
        hidden=[state.resolve(), decision_keys_folder(config).resolve()],
    )
    if "send_file" not in tools:

        async def post_file(conversation: str, name: str, data: bytes, agent: str) -> str | None:
            platform, _, chat = conversation.partition(":")
            return await sink.send_file(platform, chat, name, data, agent=agent or None)

        tools.register(SendFileTool(post_file, max_bytes=config.files.max_bytes))
    executions = ExecutionRecord(stores.primary)
    runner = AgentRunner(
        model,
        tools,
        policy,
        HistoryStore(stores.history),
        workspace_root=workspace_root or config.tools.workspaces(config.store.path),
        executions=executions,
    )
    mcp = None
    if config.mcp_servers:
        places = places_for(config, config_file=loaded.source, workspace_root=workspace_root)
        mcp = MCPSources(config.mcp_servers, tools, config.danger_level, places=places)
    agents = agents_from_config(config)
    lead = agents[config.agents.lead.name]
    transcript = TranscriptStore(stores.transcript)
    sink = RecordingSink(bus, transcript)
    conversations = Conversations(sink, runner, agents, lead)
    executor = PlanExecutor(
        PlanStore(stores.plans),
        conversations,
        lead_name=lead.name,
        assignees=set(config.agents.workers),
        executions=executions,
    )
    conversations.attach(executor)

    async def deliver(target: str, text: str) -> None:
        platform, _, chat = target.partition(":")
        await sink.send_text(platform, chat, text, agent="swarm")

    async def report(text: str) -> None:
        await bus.broadcast(text, agent="swarm")

    workers = {
        name: AgentWorker(agents[name], runner, "swarm", tuple(worker.expertise))
        for name, worker in config.agents.workers.items()
    }
    swarm = SwarmService(
        SwarmTaskStore(stores.swarm),
        workers,
        config,
        approvals=service,
        reporter=CoalescingReporter(report),
        synthesizer=model_calls.synthesizer(model),
        chooser=model_calls.chooser(model),
        refiner=model_calls.refiner(model),
        deliver=deliver,
        state=SwarmStateStore(stores.swarm),
        executions=executions,
        router=None
        if config.model.embeddings is None
        else EmbeddingRouter(
            str(config.model.base_url),
            config.model.embeddings,
            api_key=config.model.api_key,
            margin=config.swarm.routing_margin,
            deadline=config.swarm.routing_deadline_seconds,
        ),
    )
    conversations.swarm = SwarmCommands(swarm, config)
    for tool in swarm_tools(swarm, policy):
        runner.add_internal_tool(lead.name, tool)
    app = App(
        loaded,
        stores,
        service,
        policy,
        bus,
        conversations,
        executor,
        model,
        swarm,
        ChatMoves(stores.primary),
        transcript,
        mcp=mcp,
        replica=replica,
        api_keys=IdempotencyKeys(stores.primary),
        executions=executions,
    )
    if stores.pg is not None:
        from kazma.bot.replication import Replication

        app.replication = Replication(
            conninfo=stores.pg.conninfo,
            store=stores.pg,
            replica=replica,
            service=service,
            bus=bus,
            outbox=outbox,
            lead=app._lead,
            follow=app._follow,
        )
        app.inbound_claims = InboundClaims(stores.pg, replica=replica, live=app.replication.live)
    app.signed_requests = app.inbound_claims or InboundClaims(stores.primary, replica=replica)
    return app


def config_lines_for_move(loaded: LoadedConfig, move: ChatMove) -> list[str]:
    """The ``kazma.yaml`` lines that still name the old id, written as they should read now."""
    spec = CHAT_PLATFORMS.get(move.platform)
    if spec is None:
        return []
    section = spec.section(loaded.config.platforms)
    lines: list[str] = []
    listed = [str(chat) for chat in getattr(section, spec.chats_key)]
    if move.old in listed:
        now = ", ".join(move.new if chat == move.old else chat for chat in listed)
        lines.append(f"platforms.{move.platform}.{spec.chats_key}: [{now}]")
    if spec.home(loaded.config.platforms) == move.old:
        lines.append(f"platforms.{move.platform}.{spec.home_key}: {move.new}")
    return lines
