"""Press → every card settled, and what an idle Kazma costs, as the store fills with open approvals.

Runs Kazma's real adapters against the Telegram, Slack and Discord wire-level
fakes from tests/fakes (in this process), with ``N`` open approvals already in
the store (0, 1,000, 10,000 by default: pending requests whose cards are up
on all three platforms). For each N it measures:

* press → settled: a press on Slack, then every platform's card polled every
  1 ms until none shows buttons; and the Telegram card alone, while a reply to
  that very decision races the card edit for the chat's send slot (as the
  lead's answer does), p50 / p95 / worst. The poll reads the card's own
  message in each fake (``card``); ``--observers card,scan`` alternates rounds
  with the older poll (``scan``: every message of each chat, ~30 µs of this
  process's CPU per look and growing with the chat, 1-3 ms of the window it
  measures: the observer's own work delayed what it observed);
* bus overhead: from the decision (the bus told to settle) until the last
  platform's edit call starts — what Kazma adds before the platforms' own
  time (the client libraries and the fakes, in this process, are the rest);
* commits before edits: the store's group commits from the press until the
  last platform's edit starts (one that wrote nothing, as a checkpoint pass
  with nothing new, costs no fsync), a count the machine's load does not
  change (p50 and max);
* idle: CPU seconds this process spends per wall second with nothing to do
  (the fakes' own idle work included), over ``--idle`` seconds;
* with ``--stages``: where a press's time goes, each stage from the press (p50 ms since the press left the
  bench, and the CPU seconds this process spent by then: the fakes run in it too): the Slack request
  through the replay guard, the decision committed, the checkpoint holding it signed and committed, the
  bus's edits started and each platform's edit returned (its fake saw it).

With ``--latency`` the fakes answer every API call after a fixed delay
(Telegram 50 ms, Slack 150 ms, Discord 300 ms) instead of at once. Prints
numbers; asserts nothing.

    PYTHONPATH=. python bench/settle_latency.py [--rounds 20] [--open 0,1000,10000] [--idle 10] [--latency] [--stages]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kazma.adapters.bus import FanOutBus
from kazma.approvals.model import Decision
from kazma.approvals.store import ApprovalStore
from kazma.bot import start_gc
from kazma.bot.app import App, build_app
from kazma.bot.logging import configure_logging
from kazma.config import load_config_text
from tests.fakes.discord import HOME_CHANNEL_ID
from tests.platforms_support import PLATFORMS, SLACK_CHANNEL, TG_CHAT, Fakes, adapters_for, three_fakes

LATENCY = {"telegram": 0.05, "slack": 0.15, "discord": 0.30}
CHATS = {"telegram": str(TG_CHAT), "slack": SLACK_CHANNEL, "discord": str(HOME_CHANNEL_ID)}


async def seed_open(store: ApprovalStore, count: int) -> None:
    """``count`` pending requests with a card recorded on every platform (durable: a restart keeps them open)."""
    for n in range(count):
        request = await store.insert(
            tool="shell",
            args_json=f'{{"n": {n}}}',
            args_hash=f"{n:064x}",
            requested_by="agent:bench",
            conversation="web:bench",
            deadline=time.time() + 86_400,
            task_id=None,
            durable=True,
        )
        for platform in PLATFORMS:
            await store.record_card(request.id, platform, CHATS[platform], f"seed-{n}")


async def until(predicate: Callable[[], bool], *, every: float = 0.001, limit: float = 60.0) -> None:
    """Poll ``predicate`` every ``every`` seconds: the fakes change state in their own handlers."""
    async with asyncio.timeout(limit):
        while not predicate():  # noqa: ASYNC110 - the resolution of the measurement is this poll
            await asyncio.sleep(every)


STAGES = (
    "replay guard in",
    "replay guard committed",
    "decision in",
    "decision committed",
    "bus told",
    "checkpoint committed",
    "witness read",
    "edit started telegram",
    "edit started slack",
    "edit started discord",
    "edit done telegram",
    "edit done slack",
    "edit done discord",
)


def stage_marks(app: App, marks: dict[str, tuple[float, float]]) -> None:
    """Wrap Kazma's own steps of a press (never a client library) to stamp (wall, CPU) when each is reached."""

    def mark(name: str) -> None:
        marks.setdefault(name, (time.perf_counter(), time.process_time()))

    def wrap(owner: Any, attr: str, before: str, after: str) -> None:
        inner = getattr(owner, attr)

        async def timed(*args: Any, **kwargs: Any) -> Any:
            mark(before)
            result = await inner(*args, **kwargs)
            mark(after)
            return result

        setattr(owner, attr, timed)

    if app.signed_requests is not None:
        wrap(app.signed_requests, "first_signed", "replay guard in", "replay guard committed")
    wrap(app.service.store, "press", "decision in", "decision committed")
    if app.checkpointer is not None:
        wrap(app.checkpointer, "sign", "checkpoint in", "checkpoint committed")
    wrap(app.bus, "_witness", "witness in", "witness read")
    wrap(app.bus, "settle", "bus told", "bus told")
    wrap(app.bus, "settle_decided", "bus told", "bus told")  # a press's: the request and cards as committed
    for adapter in app.bus.adapters.values():
        wrap(adapter, "settle_card", f"edit started {adapter.name}", f"edit done {adapter.name}")


def card_watch(fakes: Fakes) -> Callable[[str], bool]:
    """Whether each platform's card (the one with buttons now: the earlier rounds' are settled) still shows them,
    read from that one message in its fake: a look costs a dict lookup, whatever the chat holds."""
    tg = next(m.message_id for m in fakes.telegram.bot_messages(TG_CHAT) if m.buttons)
    sl = next(m.ts for m in fakes.slack.channel(SLACK_CHANNEL) if m.block("kazma_actions"))
    dc = next(int(m["id"]) for m in fakes.discord.channel_messages(HOME_CHANNEL_ID) if m.get("components"))

    def shows(platform: str) -> bool:
        if platform == "telegram":
            return bool(fakes.telegram.message(TG_CHAT, tg).buttons)
        if platform == "slack":
            return bool(fakes.slack.message(SLACK_CHANNEL, sl).block("kazma_actions"))
        return bool(fakes.discord.messages[dc].get("components"))

    return shows


def gone(shows: Callable[[str], bool], platforms: Sequence[str]) -> Callable[[], bool]:
    """Whether none of ``platforms``' cards shows buttons any more."""
    return lambda: not any(shows(p) for p in platforms)


async def measure(
    fakes: Fakes,
    store_path: Path,
    seeded: int,
    rounds: int,
    idle: float,
    *,
    stages: bool = False,
    observers: tuple[str, ...] = ("card",),
) -> dict[str, list[float]]:
    loaded = load_config_text(fakes.config_yaml(store_path), environ={})
    app: App = await build_app(loaded, adapters=adapters_for(loaded), workspace_root=store_path.parent / "ws")
    await seed_open(app.service.store, seeded)
    staged: dict[str, tuple[float, float]] = {}
    if stages:
        stage_marks(app, staged)
    await app.start()
    start_gc.served()  # as `kazma run` does once it serves: what the start holds frozen (kazma.bot.start_gc)
    fakes.slack_events_url = app.bus.adapters["slack"].events_url  # type: ignore[attr-defined]
    results: dict[str, list[float]] = {
        "all settled": [],
        "telegram, reply racing": [],
        "bus overhead": [],
        "commits before edits": [],
        "idle cpu %": [],
        **{f"all settled ({o})": [] for o in observers[1:]},
        **{f"telegram, reply racing ({o})": [] for o in observers[1:]},
        **{f"at {name}": [] for name in STAGES},
        **{f"cpu {name}": [] for name in STAGES},
    }
    writer = await app.service.store.tables.writer()
    commits: dict[str, int] = {}  # the store's committed groups when the press left the bench, when each edit began

    def committed() -> int:
        return int(getattr(writer, "groups", 0))  # every write of the press commits through this one writer

    reply_to: list[str] = []
    marks: dict[str, float] = {}
    # Timestamps only: the bench wraps Kazma's own bus and adapters, never a client library.
    settle = app.bus.settle

    async def timed_settle(request_id: str) -> None:
        marks.setdefault("decided", time.perf_counter())
        await settle(request_id)

    app.bus.settle = timed_settle  # type: ignore[method-assign]
    assert isinstance(app.bus, FanOutBus)  # three platforms
    settle_decided = app.bus.settle_decided

    async def timed_settle_decided(request: Any, cards: Any) -> None:
        marks.setdefault("decided", time.perf_counter())
        await settle_decided(request, cards)

    app.bus.settle_decided = timed_settle_decided  # type: ignore[method-assign]
    for adapter in app.bus.adapters.values():
        edit = adapter.settle_card

        async def timed_edit(ref: Any, card: Any, outcome: Any, *, edit: Any = edit, name: str = adapter.name) -> None:
            marks.setdefault(name, time.perf_counter())
            commits.setdefault(name, committed())
            await edit(ref, card, outcome)

        adapter.settle_card = timed_edit  # type: ignore[method-assign]

    def reply(request_id: str) -> None:
        # The lead answers the decision in the same Telegram chat, at once.
        if request_id in reply_to:
            asyncio.get_running_loop().create_task(app.bus.send_text("telegram", str(TG_CHAT), "On it."))

    app.service.listeners.append(reply)
    try:
        for n in range(rounds):
            request = await app.service.open("shell", {"command": f"make release-{n}"}, "bench", "bench")
            await until(lambda: all(fakes.has_buttons(p) for p in PLATFORMS), every=0.01)
            await asyncio.sleep(1.2)  # a person takes longer than the 1 s per-chat pacing to press
            reply_to.append(request.id)
            marks.clear()
            commits.clear()
            commits["press"] = committed()
            staged.clear()
            observer = observers[n % len(observers)]
            shows = card_watch(fakes) if observer == "card" else fakes.has_buttons
            suffix = "" if observer == observers[0] else f" ({observer})"
            start, cpu_start = time.perf_counter(), time.process_time()
            # The press's own HTTP answer is not waited for: what counts is what people see change.
            press = asyncio.create_task(fakes.press("slack", Decision.APPROVE))
            await until(gone(shows, ("telegram",)))
            results["telegram, reply racing" + suffix].append(time.perf_counter() - start)
            await until(gone(shows, PLATFORMS))
            results["all settled" + suffix].append(time.perf_counter() - start)
            await press
            results["bus overhead"].append(max(marks[p] for p in PLATFORMS) - marks["decided"])
            # Group commits between the press and the last platform's edit starting: what waits on the disk.
            results["commits before edits"].append(max(commits[p] for p in PLATFORMS) - commits["press"])
            for name in STAGES if stages else ():
                if name in staged:
                    results[f"at {name}"].append(staged[name][0] - start)
                    results[f"cpu {name}"].append(staged[name][1] - cpu_start)
            await asyncio.sleep(1.2)
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.sleep(idle)  # nothing to do: what does waiting cost?
        results["idle cpu %"].append(100 * (time.process_time() - cpu) / (time.perf_counter() - wall))
    finally:
        await app.stop()
    return results


def ms(values: list[float]) -> str:
    ordered = sorted(v * 1000 for v in values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return f"{statistics.median(ordered):>8.1f}{p95:>8.1f}{ordered[-1]:>8.1f}"


async def main() -> None:
    parser = argparse.ArgumentParser(description="press -> settled latency and idle cost vs open approvals")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--open", default="0,1000,10000", help="open approvals in the store, comma-separated")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idling measured per case")
    parser.add_argument("--latency", action="store_true", help="fixed per-call latency on the fakes")
    parser.add_argument("--stages", action="store_true", help="where a press's time goes, stage by stage")
    parser.add_argument(
        "--observers",
        default="card",
        help="how a card's buttons are polled, rounds alternating: card (its own message), scan (every message)",
    )
    args = parser.parse_args()
    configure_logging("error")
    where = "fixed-latency fakes (" if args.latency else "zero-latency fakes"
    if args.latency:
        where += ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in LATENCY.items()) + ")"
    print(f"{where}; {args.rounds} presses per case; press on Slack")
    print(f"{'open approvals':<16}{'measure':<26}{'p50 ms':>8}{'p95 ms':>8}{'max ms':>8}")
    for seeded in (int(n) for n in args.open.split(",")):
        async with three_fakes() as fakes:
            if args.latency:
                fakes.telegram.latency = LATENCY["telegram"]
                fakes.slack.latency = LATENCY["slack"]
                fakes.discord.latency = LATENCY["discord"]
            with tempfile.TemporaryDirectory() as tmp:
                observers = tuple(args.observers.split(","))
                results = await measure(
                    fakes, Path(tmp) / "k.db", seeded, args.rounds, args.idle, stages=args.stages, observers=observers
                )
        shown = [n for n in results if n.startswith(("all settled", "telegram, reply racing")) and results[n]]
        for name in (*shown, "bus overhead"):
            print(f"{seeded:<16,}{name:<26}{ms(results[name])}")
        before = sorted(results["commits before edits"])
        print(f"{seeded:<16,}{'commits before edits':<26}{statistics.median(before):>8.0f}{'':>8}{before[-1]:>8.0f}")
        print(f"{seeded:<16,}{'idle CPU':<26}{results['idle cpu %'][0]:>7.2f}%")
        for name in STAGES if args.stages else ():
            at, cpu = results[f"at {name}"], results[f"cpu {name}"]
            if at:  # p50 ms since the press, and p50 CPU ms this process spent by then
                wall = statistics.median(at) * 1000
                spent = statistics.median(cpu) * 1000
                print(f"{seeded:<16,}{'  ' + name:<26}{wall:>8.1f}{'':>8}{'':>8}  cpu {spent:6.1f} ms ({len(at)})")


if __name__ == "__main__":
    asyncio.run(main())
