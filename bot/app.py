"""The composition root: every part of a running Kazma, built in dependency order and handed to the next.

:func:`build_app` only wires: each part gets what it uses when it is made, and
nothing is changed after. Two loops in the graph are real and closed once each,
by a reference that is followed only once Kazma runs: an agent's own tools start
plans and swarm work, which run agents (:class:`AgentRunner` asks for them at
each turn), and among replicas the lease hands its duties to the app that holds
the lease (it calls :meth:`App.lead` and :meth:`App.follow` once started).
:class:`App` holds the parts and answers the platforms (:attr:`App.handlers`);
how it starts, leads, sweeps and stops is :mod:`kazma.bot.lifecycle`; what the
web server may use of it is :attr:`App.console` (:mod:`kazma.bot.services`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from kazma.adapters.admission import DirectPolicy, FileBounds
from kazma.adapters.bus import SAFETY_SCAN_SECONDS, FanOutBus, NullBus
from kazma.adapters.contract import ChatMove, Handlers, Home, HomeItem, Inbound, PlatformAdapter, Press
from kazma.adapters.outbox import Outbox
from kazma.adapters.pacing import ChatRateLimiter
from kazma.adapters.web import WebAdapter
from kazma.approvals import ApprovalService, ApprovalStore, PressResult, SafetyPolicy
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.honesty import reveal_line
from kazma.approvals.model import PressVerdict, decider_text
from kazma.approvals.rules import RuleStore
from kazma.approvals.waiting import WaitingForYou
from kazma.bot.api_store import IdempotencyKeys
from kazma.bot.audit_sink import AuditSink
from kazma.bot.chat_moves import ChatMoves, config_lines_for_move
from kazma.bot.console.services import ConsoleServices
from kazma.bot.inbound_claims import InboundClaims
from kazma.bot.keys import decision_keys_folder, load_audit_signer, load_decision_keyring
from kazma.bot.lean_imports import without
from kazma.bot.lifecycle import Lifecycle
from kazma.bot.services import KazmaServices
from kazma.bot.store_handles import open_handles
from kazma.config import KazmaConfig, LoadedConfig, enabled_platforms
from kazma.config.address import Address
from kazma.config.metrics import count_failure
from kazma.config.outgoing import Outgoing
from kazma.config.registry import CHAT_PLATFORMS, load_named
from kazma.config.store.backend import StoreConnection
from kazma.engine.agent import AgentRunner, AgentSpec, InternalTool, agents_from_config
from kazma.engine.conversation import Conversations, is_question_button
from kazma.engine.history import HistoryStore
from kazma.engine.model_router import provider_for
from kazma.engine.plan_store import PlanStore
from kazma.engine.swarm import synthesis
from kazma.engine.swarm.commands import SwarmCommands
from kazma.engine.swarm.lead_tools import swarm_tools
from kazma.engine.swarm.routing import EmbeddingRouter
from kazma.engine.swarm.service import CoalescingReporter, ProgressLine, SwarmService
from kazma.engine.swarm.state_store import SwarmStateStore
from kazma.engine.swarm.store import SwarmTaskStore
from kazma.engine.swarm.workers import AgentWorker
from kazma.engine.tools.builtin import default_registry
from kazma.engine.tools.executions import ExecutionRecord
from kazma.engine.tools.registry import ToolRegistry
from kazma.engine.tools.sandbox import Sandbox, resolve_sandbox
from kazma.engine.tools.send_file import SendFileTool
from kazma.engine.transcript import RecordingSink, TranscriptStore
from kazma.engine.types import ModelProvider

log = structlog.get_logger("kazma.app")
HOME_LIMIT = 10  # waiting requests listed on a person's home page (Slack's App Home); the rest are counted
HOME_COUNTED = 1000


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
        section = spec.section(platforms)
        with without(spec.unused_imports(section)):
            factory = load_named(spec.adapter)
        # "approvers" in dm_policy: the approvers written for this platform and its admins, as for cards
        direct = DirectPolicy.of(getattr(section, "dm_policy", "off"), config.roster.approvers_for(name))
        extra: dict[str, object] = {}
        if not paced and "limiter" in inspect.signature(factory).parameters:
            extra["limiter"] = ChatRateLimiter(min_interval=0.0)
        adapters.append(
            factory(section, approve_partial=config.approvals.approve_cut_in_chat, direct=direct, files=files, **extra)
        )
    return adapters


@dataclass(kw_only=True)
class App(Lifecycle):
    """A running Kazma: its parts (started and stopped by :class:`Lifecycle`) and what the platforms call."""

    policy: SafetyPolicy
    transcript: TranscriptStore
    console: ConsoleServices  # what the web server may use (it never sees the app itself)
    # Among replicas, which replica handles each inbound event (None on SQLite: one process, nobody to race).
    inbound_claims: InboundClaims | None = None
    # The memory of signed requests and the approvals share one writer (SQLite): a press's signed request is
    # recorded in the commit of its decision (``Handlers.signed_with_press``).
    signed_with_press: bool = False

    async def on_press(self, press: Press) -> PressResult:
        first_use = None
        if press.signed and self.signed_requests is not None:
            if self.signed_with_press and not is_question_button(press.data):
                first_use = self.signed_requests.first_signed_op(press.platform, press.signed)
            elif not await self._first_signed(press):
                return PressResult(PressVerdict.REPLAYED, "", request_id=None)
        if is_question_button(press.data):
            return await self.conversations.answer_press(press, is_admin=press.is_admin)
        return await self.service.decide_from_button(
            press.data,
            actor=press.actor,
            platform=press.platform,
            chat=press.chat,
            message_id=press.message_id,
            reason=press.reason,
            first_use=first_use,
        )

    async def _first_signed(self, press: Press) -> bool:
        """The store's memory of signed requests, asked on its own (a press no decision records it with). One it
        cannot ask lets the press through, counted, as the adapters' door does."""
        assert self.signed_requests is not None
        try:
            return await self.signed_requests.first_signed(press.platform, press.signed)
        except Exception as exc:
            count_failure("replay_check", press.platform)
            log.warning("platform.replay_check_failed", platform=press.platform, error=str(exc))
            return True

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
                title=message.chat_title,
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
            signed_with_press=self.signed_with_press and self.signed_requests is not None,
            home=self.home,
            may_decide=self.may_decide,
            decided=self.decided,
            press_recorded=self.press_recorded,
        )

    async def press_recorded(self, press: Press) -> bool | None:
        """Whether a press whose decision was cut off midway committed; None for a question's button (its answer
        is the conversation's, which keeps no record to ask)."""
        if is_question_button(press.data):
            return None
        return await self.service.press_recorded(press.data, actor=press.actor)

    async def may_decide(self, actor: str, platform: str, request_id: str) -> bool:
        """Whether ``actor``'s press on ``request_id`` would count under its policy (an unknown request: True, so
        the press itself says what it is)."""
        request = await self.service.store.get(request_id)
        return request is None or self.service.may_decide_under(actor, platform, request.policy)

    async def decided(self, request_id: str) -> str | None:
        """How a press on ``request_id`` would be told its outcome when it is decided already; None while it is
        pending (or unknown: the press itself says what it is)."""
        request = await self.service.store.get(request_id)
        outcome = None if request is None else request.outcome()
        return None if outcome is None else f"Already {outcome.summary()}."

    async def home(self, actor: str, platform: str) -> Home:
        """A person's home page on a platform (Slack's App Home): the newest requests waiting for a decision, in
        the order they were asked, and how many more wait."""
        config = self.service.config
        pending = await self.service.store.requests(pending_only=True, limit=HOME_COUNTED)
        listed = sorted(pending[:HOME_LIMIT], key=lambda r: r.created_at)
        # Judged by each request's policy, as its press will be: an approver named only by a policy (a deploy
        # policy's approvers) decides its requests and no others; approvals.approvers alone said neither.
        waiting = tuple(
            HomeItem(
                f"{reveal_line(r.tool)}, asked by {reveal_line(r.requested_by)} in {reveal_line(r.conversation)}",
                self.service.link(r.id),
                yours=self.service.may_decide_under(actor, platform, r.policy),
            )
            for r in listed
        )
        return Home(
            who=decider_text(config.roster.person_of(actor), actor),
            may_decide=self.service.decides_anywhere(actor, platform),
            waiting=waiting,
            more=max(0, len(pending) - HOME_LIMIT),
            console=str(config.web.public_url).rstrip("/"),
        )

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
            await self.bus.send(Address(move.platform, move.new), Outgoing(text, agent=self.conversations.lead.name))
        except Exception as exc:  # recorded and logged already; a chat that refuses the notice changes nothing
            log.warning("chat.move_not_announced", platform=move.platform, chat=move.new, error=str(exc))


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
    # bubblewrap's trial run is a process of its own (tens of ms): it runs on a thread while the store opens and the
    # platforms' libraries are imported, instead of holding the event loop before them
    sandbox = (
        None
        if registry is not None
        else asyncio.ensure_future(asyncio.to_thread(resolve_sandbox, config.tools.sandbox))
    )
    stores = await open_handles(config, replica=replica)
    try:
        keyring = load_decision_keyring(config)  # seals every outcome; made at first start on SQLite
        signer = load_audit_signer(config)  # signs the audit chain's checkpoints; made beside it on SQLite
    except BaseException:
        await stores.close()
        raise

    # Approvals and the platforms that show their cards. The store names this replica as the owner of what it
    # opens only once it serves (App.start): a command that only builds the app (`kazma swarm`) holds no lease,
    # so nobody could tell whether it is alive.
    store = ApprovalStore(stores.primary, keyring=keyring, audit=signer)
    checkpointer = Checkpointer(store, signer)  # settled cards wait on it for the checkpoint holding a decision
    platforms = build_adapters(loaded, paced=paced) if adapters is None else list(adapters)
    if web is not None:
        platforms.append(web)
    outbox = Outbox(stores.outbox, replica=replica)
    bus: FanOutBus | NullBus = (
        FanOutBus(
            platforms,
            store=store,
            outbox=outbox,
            config=config,
            poll_interval=poll_interval,
            shared=shared,
            witnesses=checkpointer,
        )
        if platforms
        else NullBus()
    )
    # Among replicas a decision made elsewhere wakes the waiter by NOTIFY: its own reads are only a safety net.
    service = ApprovalService(
        store, config, publisher=bus, rules=RuleStore(stores.primary), poll_interval=30.0 if shared else 0.5
    )
    policy = SafetyPolicy(service)

    # What agents say is kept for the console as it is sent.
    transcript = TranscriptStore(stores.transcript)
    sink = RecordingSink(bus, transcript)

    # The agents, their tools, the swarm and the conversations.
    model = provider or provider_for(config)
    if registry is None:
        assert sandbox is not None  # started above for exactly this case
        registry = _builtin_tools(config, await sandbox, config_file=loaded.source)
    tools = registry
    if "send_file" not in tools:
        tools.register(_send_file(sink, config))
    # An agent's own tools start plans and swarm work, which run agents on this runner: they are made below
    # with the conversations and the swarm, and the runner asks for them only once a turn runs.
    conversations: Conversations
    lead_swarm_tools: list[InternalTool]

    def own_tools(agent: str) -> list[InternalTool]:
        swarm_work = lead_swarm_tools if agent == config.agents.lead.name else []
        return [*conversations.plan_tools(agent), *swarm_work]

    # Every tool execution's row, before it starts and when it ends: what each ending says ran or may have run.
    executions = ExecutionRecord(stores.primary)
    service.executions_of = executions.outcomes_of_requests  # recovery asks it whether an approved call started
    runner = AgentRunner(
        model,
        tools,
        policy,
        HistoryStore(stores.history),
        workspace_root=workspace_root or config.tools.workspaces(config.store.path),
        own_tools=own_tools,
        executions=executions,
    )
    mcp = None
    if config.mcp_servers:  # MCP's client machinery (anyio, the stdio launcher) is imported only when configured
        from kazma.engine.tools.mcp_launch import places_for
        from kazma.engine.tools.mcp_tools import MCPSources

        places = places_for(config, config_file=loaded.source, workspace_root=workspace_root)
        mcp = MCPSources(config.mcp_servers, tools, config.danger_level, places=places)
    agents = agents_from_config(config)
    swarm = _swarm(
        config,
        stores.swarm,
        runner=runner,
        agents=agents,
        approvals=service,
        bus=bus,
        sink=sink,
        model=model,
        executions=executions,
    )
    lead_swarm_tools = swarm_tools(swarm, policy)
    conversations = Conversations(
        sink,
        runner,
        agents,
        agents[config.agents.lead.name],
        plans=PlanStore(stores.plans),
        swarm=SwarmCommands(swarm, config),
        waiting=WaitingForYou(service),
    )
    assert conversations.executor is not None  # given a plan store, the conversations made their executor

    # Among replicas: the lease, and who handles each inbound event.
    replication = None
    inbound_claims = None
    app: App  # made last; the lease calls it only once it runs (App.start)
    if stores.pg is not None:
        from kazma.bot.replication import Replication

        replication = Replication(
            conninfo=stores.pg.conninfo,
            store=stores.pg,
            replica=replica,
            service=service,
            bus=bus,
            outbox=outbox,
            lead=lambda: app.lead(),
            follow=lambda reason: app.follow(reason),
        )
        inbound_claims = InboundClaims(stores.pg, replica=replica, live=replication.live)
    api_keys = IdempotencyKeys(stores.primary)
    app = App(
        loaded=loaded,
        stores=stores,
        service=service,
        policy=policy,
        bus=bus,
        conversations=conversations,
        executor=conversations.executor,
        provider=model,
        swarm=swarm,
        chat_moves=ChatMoves(stores.primary),
        transcript=transcript,
        mcp=mcp,
        replica=replica,
        replication=replication,
        inbound_claims=inbound_claims,
        signed_requests=inbound_claims or InboundClaims(stores.primary, replica=replica),
        # One SQLite file: the approvals store and that memory of signed requests write through one writer.
        signed_with_press=inbound_claims is None,
        api_keys=api_keys,
        executions=executions,
        checkpointer=checkpointer,
        audit_sink=None if config.audit.sink is None else AuditSink.of(store, stores.primary, config.audit.sink),
        console=KazmaServices(
            config=config,
            store=stores.primary,
            approvals=service,
            api_keys=api_keys,
            swarm=swarm,
            conversations=conversations,
            transcript=transcript,
            replica=replica,
            replication=replication,
            bus=bus,
        ),
    )
    return app


def _builtin_tools(config: KazmaConfig, sandbox: Sandbox, *, config_file: Path | None = None) -> ToolRegistry:
    state = config.store.path.parent
    # The store, the tokens, the sessions, the decision and audit keys, and kazma.yaml (it may hold platform
    # tokens; kept where the sandbox binds system files, /usr/local/etc, it was readable): never visible to a
    # command, as to an MCP server.
    hidden = [state.resolve(), decision_keys_folder(config).resolve()]
    if config_file is not None:
        hidden.append(config_file.resolve())
    return default_registry(sandbox=sandbox, shell_network=config.tools.shell_network, hidden=hidden)


def _send_file(sink: RecordingSink, config: KazmaConfig) -> SendFileTool:
    async def post_file(conversation: str, name: str, data: bytes, agent: str) -> str | None:
        return await sink.send(Address.parse(conversation), Outgoing.of_file(name, data, agent=agent or None))

    return SendFileTool(post_file, max_bytes=config.files.max_bytes)


def _swarm(
    config: KazmaConfig,
    conn: StoreConnection,
    *,
    runner: AgentRunner,
    agents: Mapping[str, AgentSpec],
    approvals: ApprovalService,
    bus: FanOutBus | NullBus,
    sink: RecordingSink,
    model: ModelProvider,
    executions: ExecutionRecord,
) -> SwarmService:
    """The swarm: its workers run on the agents' runner, its results go where they were asked for and its
    reports to every platform."""

    async def deliver(target: str, text: str) -> None:
        await sink.send(Address.parse(target), Outgoing(text, agent="swarm"))

    async def report(text: str) -> None:
        await bus.broadcast(text, agent="swarm")

    async def report_lines(lines: Sequence[ProgressLine]) -> None:
        # a home chat a task's result is delivered to hears its ending there, not twice
        heard = {line.heard_in for line in lines if line.heard_in}
        await bus.broadcast("\n".join(line.text for line in lines), agent="swarm", skip=heard)
        for conversation in heard:
            rest = [line.text for line in lines if line.heard_in != conversation]
            if rest:
                await bus.broadcast("\n".join(rest), agent="swarm", only=conversation)

    workers = {
        name: AgentWorker(agents[name], runner, "swarm", tuple(worker.expertise))
        for name, worker in config.agents.workers.items()
    }
    return SwarmService(
        SwarmTaskStore(conn),
        workers,
        config,
        approvals=approvals,
        reporter=CoalescingReporter(report, send_lines=report_lines, held=True),  # until the platforms are up
        synthesizer=synthesis.synthesizer(model),
        chooser=synthesis.chooser(model),
        refiner=synthesis.refiner(model),
        deliver=deliver,
        state=SwarmStateStore(conn),
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
