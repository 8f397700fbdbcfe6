"""The composition root: store, approvals, platforms and the bus, wired together."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import aiosqlite
import structlog

from kazma.adapters.bus import FanOutBus, NullBus
from kazma.adapters.contract import Handlers, Inbound, PlatformAdapter
from kazma.adapters.outbox import Outbox
from kazma.approvals import ApprovalService, ApprovalStore, PressResult, SafetyPolicy
from kazma.bot.store import open_store
from kazma.config import LoadedConfig, enabled_platforms
from kazma.config.database import connect
from kazma.config.metrics import count_failure

log = structlog.get_logger("kazma.app")


def build_adapters(loaded: LoadedConfig) -> list[PlatformAdapter]:
    """One adapter per platform with a token. Imported lazily: each library is heavy."""
    platforms = loaded.config.platforms
    adapters: list[PlatformAdapter] = []
    for name in enabled_platforms(loaded):
        if name == "telegram":
            from kazma.adapters.telegram import TelegramAdapter

            adapters.append(TelegramAdapter(platforms.telegram))
        elif name == "slack":
            from kazma.adapters.slack import SlackAdapter

            adapters.append(SlackAdapter(platforms.slack))
        elif name == "discord":
            from kazma.adapters.discord import DiscordAdapter

            adapters.append(DiscordAdapter(platforms.discord))
    return adapters


@dataclass
class App:
    loaded: LoadedConfig
    conn: aiosqlite.Connection
    outbox_conn: aiosqlite.Connection
    service: ApprovalService
    policy: SafetyPolicy
    bus: FanOutBus | NullBus
    sweep_interval: float = 5.0
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def on_press(self, data: str, actor: str, platform: str) -> PressResult:
        return await self.service.decide_from_button(data, actor=actor, platform=platform)

    async def on_inbound(self, message: Inbound) -> None:
        # The lead agent and the /swarm surface plug in here (their own issues);
        # until then every message is logged so operators can see what arrives.
        log.info(
            "inbound.message",
            platform=message.platform,
            chat=message.chat,
            author=message.author,
            command=message.command,
            from_bot=message.from_bot,
            length=len(message.text),
        )

    async def start(self) -> None:
        await self.bus.start(Handlers(on_inbound=self.on_inbound, on_press=self.on_press))
        self._tasks.append(asyncio.create_task(self._sweep(), name="kazma-approvals-sweep"))
        log.info("app.started", platforms=sorted(self.bus.adapters), store=str(self.loaded.config.store.path))

    async def _sweep(self) -> None:
        """End requests whose waiter died with an earlier process, so their cards settle too."""
        while True:
            try:
                for outcome in await self.service.expire_overdue():
                    log.info("approvals.swept", request_id=outcome.request_id, status=outcome.status.value)
            except Exception as exc:
                count_failure("approval_sweep")
                log.warning("approvals.sweep_failed", error=str(exc))
            await asyncio.sleep(self.sweep_interval)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.bus.stop()
        await self.outbox_conn.close()
        await self.conn.close()
        log.info("app.stopped")


async def build_app(loaded: LoadedConfig, *, poll_interval: float = 1.0) -> App:
    config = loaded.config
    conn = await open_store(config)
    outbox_conn = await connect(config.store.path, busy_timeout_ms=config.store.busy_timeout_ms)
    store = ApprovalStore(conn)
    adapters = build_adapters(loaded)
    bus: FanOutBus | NullBus
    if adapters:
        bus = FanOutBus(adapters, store=store, outbox=Outbox(outbox_conn), config=config, poll_interval=poll_interval)
    else:
        bus = NullBus()
    service = ApprovalService(store, config, publisher=bus)
    return App(loaded, conn, outbox_conn, service, SafetyPolicy(service), bus)
