"""One chaos cell: a real ``kazma run`` with one failpoint armed, on the wire-level fakes, driven through one
approved shell call, restarted when it died (or hung), and what happened kept for the checker.

The scenario crosses every boundary of an approval: a person asks the lead in Telegram; the lead's model asks
for a shell call (it writes a marker line in its workspace: the tool's real effect, counted from outside);
the request opens, its card is posted to Telegram and Discord, a person presses Approve on Telegram, the
decision commits and settles both cards, the call runs and is recorded, the model answers. A process that
died is started again without the failpoint, as an operator would; a card still live then is pressed again,
as a person would.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import discord

from tests.audit_support import KEY_ENV
from tests.child_env import child_env
from tests.fakes.discord import ALICE_ID, HOME_CHANNEL_ID, FakeDiscord
from tests.fakes.openai import Completion, FakeOpenAI, FakeToolCall
from tests.fakes.telegram import FakeTelegram

TG_CHAT = -1001
TG_ADMIN = 111
MODEL = "chaos-model"
ASK = "@kazma write the marker"
DONE = "Done: the marker is written."
MARKER = "marker.txt"
STEP_SECONDS = 30.0  # the longest any step of the scenario may take before the cell calls the process hung
REPLICA = "chaos-a"  # on PostgreSQL: the replica's name, the same after a restart
# A restarted process says ``app.recovered`` once it has ended what its previous life left (orphans cancelled,
# notices told, every card post and edit then due tried): the cell looks at the cards from then on. Not saying it
# by then is the cell's failure (a recovery that never ends), not a bound the cell expects to wait out.
RECOVER_SECONDS = 2 * STEP_SECONDS
STOP_SECONDS = 60.0  # a process asked to stop and not ended by then is killed (it did not stop cleanly)


@dataclass
class History:
    """What one cell did and saw, read by the checker (nothing here is Kazma's own account of itself)."""

    point: str
    action: str
    store: str  # "sqlite" | "postgresql"
    where: str  # the SQLite file, or the PostgreSQL DSN
    workspace: Path
    died: bool = False  # the armed process ended by itself (a crash)
    hung: bool = False  # it stopped making progress and was killed
    restarts: int = 0
    presses: int = 0  # Approve pressed on Telegram
    fired: bool = False  # the failpoint said it fired (its line on stderr)
    telegram_cards: list[str] = field(default_factory=list)  # every card message's final text
    telegram_live: int = 0  # cards still carrying buttons at the end
    discord_cards: list[str] = field(default_factory=list)
    discord_live: int = 0
    discord_nonces: list[str] = field(default_factory=list)
    asked_model: int = 0  # model requests whose last message is the person's ask (a turn run per delivery)
    bot_texts: list[str] = field(default_factory=list)
    clean_exit: bool = True  # the last process stopped cleanly on SIGTERM


class RigError(AssertionError):
    """The rig could not run its scenario (a process never came up): no ending to judge, the cell fails."""


class Rig:
    """The wire fakes (Telegram, Discord, the model) and how one ``kazma run`` on them is configured and started."""

    def __init__(
        self,
        tmp: Path,
        *,
        store: str,
        dsn: str | None,
        web_port: int = 0,
        extra: str = "",
        tools: str = "[shell]",
        ready: Callable[[], bool] = lambda: True,
    ) -> None:
        self.tmp = tmp
        self.store = store
        self.dsn = dsn
        self.web_port = web_port  # 0: any free port (nobody calls the console)
        self.extra = extra  # more top-level YAML for the config (a scenario's own sections)
        self.tools = tools  # the lead's tools (YAML)
        self.ready = ready  # beyond the platforms: what must be up before anyone asks (an MCP server)
        self.log = tmp / "kazma.log"
        self.telegram = FakeTelegram()
        self.discord = FakeDiscord()
        self.model = FakeOpenAI(models=(MODEL,))

    def config(self) -> Path:
        (self.tmp / "state").mkdir(exist_ok=True)  # the workspaces must be outside the store's folder
        where = f"{{url: '{self.dsn}'}}" if self.store == "postgresql" else f"{{path: '{self.tmp / 'state' / 'k.db'}'}}"
        path = self.tmp / "kazma.yaml"
        path.write_text(
            f"""
store: {where}
web: {{port: {self.web_port}}}
model: {{base_url: '{self.model.base_url}', name: {MODEL}, timeout_seconds: 60, max_retries: 0}}
tools: {{workspace_root: '{self.tmp / "ws"}'}}
agents: {{lead: {{tools: {self.tools}}}}}
platforms:
  telegram:
    token: '{self.telegram.token}'
    api_base_url: '{self.telegram.base_url}'
    chats: [{TG_CHAT}]
    home_chat: {TG_CHAT}
    admins: [{TG_ADMIN}]
  discord:
    token: '{self.discord.token}'
    api_base_url: '{self.discord.api_base}'
    gateway_url: '{self.discord.gateway_url}'
    channels: [{HOME_CHANNEL_ID}]
    home_channel: {HOME_CHANNEL_ID}
    admins: [{ALICE_ID}]
{self.extra}"""
        )
        return path

    async def start(self, failpoints: str, *, replica: str = REPLICA) -> asyncio.subprocess.Process:
        env = child_env({"NO_PROXY": "127.0.0.1,localhost", "KAZMA_FAILPOINTS": failpoints})
        if self.store == "postgresql":
            # A replica as deploy/compose.yaml runs one: the console's tokens and the keys every replica shares
            # (refused at start otherwise), and a name of its own that its restart keeps, so the restart ends
            # what its previous life left (under <host>:<pid> that waits for the leader to judge it gone).
            env |= {"KAZMA_WEB_TOKEN": "o" * 40, "KAZMA_WEB_READER_TOKEN": "r" * 40, **KEY_ENV}
            env["KAZMA_REPLICA"] = replica
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kazma.bot.cli", "-c", str(self.config()), "--log-format", "json", "run",
            "--poll-interval", "0.1",
            stdout=asyncio.subprocess.DEVNULL, stderr=self.log.open("ab"), env=env, cwd=str(self.tmp),
        )  # fmt: skip

    # -- what the fakes show ------------------------------------------------------------------------

    def tg_cards(self) -> list[object]:
        return [m for m in self.telegram.bot_messages(TG_CHAT) if "Approval needed" in m.text]

    def tg_live(self) -> list[object]:
        return [m for m in self.telegram.bot_messages(TG_CHAT) if m.buttons]

    def dc_cards(self) -> list[dict[str, object]]:
        return [m for m in self.discord.channel_messages(HOME_CHANNEL_ID) if m.get("embeds")]

    def dc_live(self) -> list[dict[str, object]]:
        return [m for m in self.discord.channel_messages(HOME_CHANNEL_ID) if m.get("components")]

    def started(self) -> int:
        """How many times a process said ``app.started`` in the log (appended by every process of the cell)."""
        return self.log.read_text(errors="replace").count('"event": "app.started"') if self.log.exists() else 0

    def recovered(self) -> int:
        """How many times a process said ``app.recovered``: it ended what its previous life left."""
        return self.log.read_text(errors="replace").count('"event": "app.recovered"') if self.log.exists() else 0

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else "(no log)"

    def done(self) -> bool:
        return any(DONE in m.text for m in self.telegram.bot_messages(TG_CHAT))

    def answered(self) -> bool:
        """The person heard back: the model's answer, or Kazma saying why there is none (not a card)."""
        return any("Approval needed" not in m.text for m in self.telegram.bot_messages(TG_CHAT))

    def press(self) -> None:
        card = next(m for m in self.telegram.bot_messages(TG_CHAT) if m.buttons)
        data = str(next(b["callback_data"] for b in card.buttons if str(b["callback_data"]).endswith(":a")))
        self.telegram.push_callback(TG_CHAT, card.message_id, TG_ADMIN, data)


async def _until(predicate: Callable[[], bool], proc: asyncio.subprocess.Process, seconds: float) -> bool:
    """Wait for ``predicate`` (True), the process's end or the bound (False)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while not predicate():
        if proc.returncode is not None or loop.time() > end:
            return predicate()
        await asyncio.sleep(0.05)
    return True


async def _connected(s: Rig, proc: asyncio.subprocess.Process, polls: int, identifies: int, started: int) -> bool:
    """Serving: both platforms connected and the app said it started (its bus shows cards from then on)."""
    return await _until(
        lambda: (
            len(s.telegram.calls_to("getUpdates")) > polls
            and len(s.discord.identifies) > identifies
            and s.started() > started
            and s.ready()
        ),
        proc,
        60,
    )


async def _recovered(s: Rig, proc: asyncio.subprocess.Process, before: int) -> None:
    """Wait for ``proc`` (restarted) to say it ended what its previous life left: one more ``app.recovered`` than
    ``before`` (the count before it started). Never said: the cell fails."""
    if not await _until(lambda: s.recovered() > before, proc, RECOVER_SECONDS):
        await _stop(proc, signal.SIGKILL)
        raise RigError(f"the restarted kazma run never said it recovered (app.recovered): {s.log_tail()}")


async def _stop(proc: asyncio.subprocess.Process, sig: signal.Signals) -> bool:
    """Stop ``proc`` with ``sig``; False when it had to be killed after STOP_SECONDS (it did not stop cleanly)."""
    if proc.returncode is None:
        proc.send_signal(sig)
    try:
        await asyncio.wait_for(proc.wait(), timeout=STOP_SECONDS)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return False
    return True


@asynccontextmanager
async def fakes(s: Rig) -> AsyncIterator[Rig]:
    saved = (discord.http.Route.BASE, discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY)
    await asyncio.gather(s.telegram.start(), s.discord.start(), s.model.start())
    try:
        yield s
    finally:
        await asyncio.gather(s.telegram.stop(), s.discord.stop(), s.model.stop(), return_exceptions=True)
        discord.http.Route.BASE, discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = saved


async def _drive_approval(s: Rig, proc: asyncio.subprocess.Process, h: History, ask: bool) -> bool:
    """The scenario's steps on ``proc``; True when it reached its end (the model's answer, cards settled)."""
    if ask:
        s.telegram.push_message(TG_CHAT, TG_ADMIN, ASK, username="ops")
    # a card to press (after a restart, which has recovered by now: one still live, or posted again by the new
    # process; usually none, the request ended at the restart and its cards are settled)
    if ask and not await _until(lambda: bool(s.tg_live()) or s.done(), proc, STEP_SECONDS):
        return False  # asked, and within the bound neither a card nor an answer: stuck
    if s.tg_live() and not s.done():
        s.press()
        h.presses += 1
        await _until(lambda: s.done() or (not s.tg_live() and not s.dc_live()), proc, STEP_SECONDS)
    # the cards settle after the decision: wait for both platforms' edits
    if not await _until(lambda: not s.tg_live() and not s.dc_live(), proc, STEP_SECONDS):
        return False
    if ask and not await _until(s.answered, proc, STEP_SECONDS):
        return False  # the person never heard back: stuck (a call that never ends, a turn that never answers)
    return proc.returncode is None and not s.tg_live() and not s.dc_live()


# A scenario's steps on one process: (rig, process, history, first) -> reached its end. ``first``: the armed
# process, asked from scratch; else the restarted one, which only finishes what is left (a card still live).
Drive = Callable[[Rig, asyncio.subprocess.Process, History, bool], Awaitable[bool]]


async def run_restarting(s: Rig, h: History, spec: str, drive: Drive) -> None:
    """One process with ``spec`` armed, driven by ``drive``; when it died (or made no progress: killed as hung) one
    more without a failpoint, driven again, as an operator would restart it. Fills ``h``'s process facts."""
    first = await s.start(spec)
    if not await _connected(s, first, 0, 0, 0):
        await _stop(first, signal.SIGKILL)
        raise RigError(f"the first kazma run never came up: {s.log_tail()}")
    settled = await drive(s, first, h, True)
    if first.returncode is not None:
        h.died = True
    elif not settled:
        h.hung = True  # alive, and no progress within the bound: a hang (or a stuck ending)
        await _stop(first, signal.SIGKILL)
    else:
        h.clean_exit = await _stop(first, signal.SIGTERM) and first.returncode == 0
    if h.died or h.hung:
        h.restarts = 1
        polls, identifies = len(s.telegram.calls_to("getUpdates")), len(s.discord.identifies)
        started, recovered = s.started(), s.recovered()
        second = await s.start("")
        if not await _connected(s, second, polls, identifies, started):
            await _stop(second, signal.SIGKILL)
            raise RigError(f"the restarted kazma run never came up: {s.log_tail()}")
        await _recovered(s, second, recovered)
        await drive(s, second, h, False)
        h.clean_exit = await _stop(second, signal.SIGTERM) and second.returncode == 0
    h.fired = '"failpoint.fired"' in s.log.read_text(errors="replace")


def observe(s: Rig, h: History, ask: str = ASK) -> None:
    """What the fakes show at the end, into ``h``: the cards, the conversation, the turns run on ``ask``."""
    h.telegram_cards = [m.text for m in s.tg_cards()]  # type: ignore[attr-defined]
    h.telegram_live = len(s.tg_live())
    h.discord_cards = [_discord_text(m) for m in s.dc_cards()]
    h.discord_live = len(s.dc_live())
    h.discord_nonces = [str(m.get("nonce")) for m in s.dc_cards() if m.get("nonce") is not None]
    h.asked_model = sum(1 for r in s.model.completions if _last_user(r.body, ask) == ask)
    h.bot_texts = [m.text for m in s.telegram.bot_messages(TG_CHAT)]


def history(tmp: Path, point: str, action: str, store: str, dsn: str | None) -> History:
    where = dsn if store == "postgresql" else str(tmp / "state" / "k.db")
    return History(point, action, store, where or "", tmp / "ws")


async def run_cell(tmp: Path, point: str, action: str, *, store: str = "sqlite", dsn: str | None = None) -> History:
    """The approval scenario's driver: one approved shell call, asked in Telegram, pressed there."""
    s = Rig(tmp, store=store, dsn=dsn)
    h = history(tmp, point, action, store, dsn)
    async with fakes(s):
        s.model.script(
            Completion(tool_calls=(FakeToolCall("shell", json.dumps({"command": f"echo ran >> {MARKER}"})),)),
            Completion(content=DONE),
        )
        await run_restarting(s, h, f"{point}={action}" if point else "", _drive_approval)
        observe(s, h)
    return h


def _last_user(body: dict[str, object], ask: str) -> str | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "user":
        return None
    content = str(last.get("content", ""))
    return ask if ask in content else content


def _discord_text(message: dict[str, object]) -> str:
    parts = [str(message.get("content") or "")]
    embeds = message.get("embeds")
    for embed in embeds if isinstance(embeds, list) else []:
        parts += [str(embed.get("title", "")), str(embed.get("description", ""))]
        parts += [f"{f.get('name', '')} {f.get('value', '')}" for f in embed.get("fields", [])]
        parts.append(str((embed.get("footer") or {}).get("text", "")))
    return " ".join(parts)
