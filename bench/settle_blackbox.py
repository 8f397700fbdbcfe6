"""Black-box press → all three cards edited: `kazma run` as a real child process, the platforms' fakes in this one.

bench/settle_latency.py runs Kazma's adapters and the three wire-level fakes on one event loop in one process,
so the fakes' and the client libraries' CPU is serialised with Kazma's and counted in the window it measures.
Here Kazma is what a deployment runs: ``python -m kazma.bot.cli -c kazma.yaml --log-format json run`` (default
log level, per-chat pacing on), spawned as bench/idle_rss.py spawns it, against the Telegram, Slack and Discord
fakes from tests/fakes running in this process (one set of three per child). Each round, for one child:

* spacing: a child's rounds start ``ROUND_EVERY`` (6.5 s) apart, so Telegram's pacing (twenty sends a minute
  per group) never holds a card's edit; ``--no-pacing`` runs the children with ``kazma run --no-pacing`` and
  rounds back to back instead;
* open: ``POST /api/v1/approvals`` with an API token (role ``approval_requester``), as a CI job would; then the
  fakes are polled (every 5 ms) until the request's card shows its buttons on all three platforms, and left
  alone 1.2 s (a person takes longer than the 1 s per-chat pacing to press, as in settle_latency.py);
* press: Approve on Slack, over the wire as Slack sends it: a signed ``block_actions`` POST to the child's
  Slack endpoint (its answer is not waited for: what counts is what people see change);
* settled: each platform's card message (read from its fake: a dict lookup per look, whatever the chat holds)
  polled every ~1 ms from this process — which is not Kazma's — until none shows buttons. Printed: press →
  every card edited, p50 / p95 / max over ``--rounds`` (after ``--warmup`` rounds), and each platform's own
  p50 (when its card lost its buttons);
* CPU: the child's CPU (every thread: Kazma's loop and its SQLite thread) from the press to the last card
  edited, and over the whole round (open, fan-out, 1.2 s idle, press, edits), read from
  ``/proc/<pid>/task/*/schedstat`` (nanoseconds; ``/proc/<pid>/stat``'s clock ticks are 10 ms, as long as the
  window), and this process's CPU over the same window (the fakes' handlers, the press's client, the poll);
* the child's own account: p50 from the press leaving this process to the lines its log writes (``--log-format
  json``, stamped with ``time.time()``, the clock this process stamps the press with): the press read
  (``platform.press``), the decision committed (``approvals.decided``), the first and the last platform's edit
  call returned (``platform.card_settled``). What the log costs is in every figure: the default level logs these.

Side by side with ``--anchor REV`` (default main): that revision's tree exported with ``git archive`` and linked
as ``kazma.<layer>`` (bench/idle_rss.py's ``anchor_path``), its own child and fakes; the two children are
started together and their rounds alternate one by one, so the machine's load falls on both alike. ``--runs``
times, each with fresh children and stores.

With ``--pin`` each child runs on one CPU and this process (the fakes, the press, the poll) on another (the first two
this process may use): the fakes stand
for platforms on other machines, and unpinned, the scheduler often ran this process on the child's CPU as a card's
request woke it (Linux prefers the waker's CPU), holding the child's next request back by the fake's work (~1 ms).
Kazma then has one CPU for its loop and its store's thread, where unpinned it has two.

With ``--steps`` each child also times its event loop's callbacks (bench/loop_steps/sitecustomize.py, ~2 µs a
callback more) and, after each run, the median round of each tree is printed step by step: every callback of
30 µs or more between the press leaving this process and its last card edited, with its wall and CPU time.

First, this machine's floor (:func:`machine_floor`): a bare aiohttp POST to another process, after the idle a
press comes after and back to back, printed before the table. Every window in the table holds at least two
such hops (the press in, the edits out); on a machine whose idle CPUs wake slowly that floor is a large part
of the window, and figures from two machines compare only beside their floors.

Fan-out ≤ 1.1 × the slowest platform is not measured here: every fake answers at once, so there is no slowest
platform to compare with (bench/fanout_settle.py measures it with fixed per-call latency). The per-platform
p50s show how far apart the three edits land. Prints numbers; asserts nothing.

    PYTHONPATH=. python bench/settle_blackbox.py [--rounds 30] [--warmup 5] [--runs 3] [--anchor main]
        [--no-pacing] [--log-level warning] [--pin] [--steps]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import aiohttp

from bench.idle_rss import REPO, anchor_path, compile_tree, load
from tests.contract.harness import free_port
from tests.fakes.discord import HOME_CHANNEL_ID
from tests.platforms_support import PLATFORMS, SLACK_ADMIN, SLACK_CHANNEL, TG_CHAT, Fakes, three_fakes

API_TOKEN = "bench-" + "b" * 40
PRESS_GAP = 1.2  # seconds between a card being up and the press: longer than the 1 s per-chat pacing
# Telegram allows a group twenty messages a minute and Kazma paces its sends to that (adapters/telegram): a round
# sends two (the card, its edit), so a child's rounds start at least this far apart. Closer, the window binds:
# each card waits for a slot, and then its edit waits (by a few ms, in step with the sends of a minute before).
ROUND_EVERY = 6.5
READY = "kazma is running"
LOOP_STEPS = REPO / "bench" / "loop_steps"  # --steps: its sitecustomize times the child's loop
# The floor: a bare aiohttp server in another process, answering a POST with nothing done (see machine_floor).
FLOOR_SERVER = """
import sys
from aiohttp import web
async def answer(request):
    await request.read()
    return web.Response(text="ok")
app = web.Application()
app.router.add_post("/", answer)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""
FLOOR_IDLE = 0.5  # seconds between the floor's spaced POSTs: long enough for an idle CPU to sleep, as between rounds


def cpu_ns(pid: int) -> int:
    """CPU nanoseconds process ``pid`` has run so far, summed over its threads (live ones: Kazma's threads
    live as long as the process)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{task}/schedstat") as stat:
            total += int(stat.read().split()[0])
    return total


@dataclass
class Round:
    settled: float  # press sent → the last card without buttons (s)
    platforms: dict[str, float]  # press sent → that platform's card without buttons (s)
    child_window: float  # the child's CPU seconds from the press to the last card edited
    child_round: float  # the child's CPU seconds over the whole round (open → settled)
    bench_window: float  # this process's CPU seconds from the press to the last card edited (fakes, poll)
    request_id: str = ""
    sent_at: float = 0.0  # time.time() when the press left this process: the child's log is stamped in that clock


@dataclass
class Child:
    """One `kazma run` with its own three fakes, state folder and ports."""

    tree: str
    pythonpath: str
    fakes: Fakes
    paced: bool
    log_level: str
    folder: Path
    steps: bool = False  # time the child's event-loop callbacks (--steps)
    cpus: set[int] | None = None  # the CPUs the child runs on (--pin)
    web_port: int = field(default_factory=free_port)
    slack_port: int = field(default_factory=free_port)
    process: asyncio.subprocess.Process | None = None
    next_round: float = 0.0  # time.monotonic() before which this child's next round may not start

    @property
    def log(self) -> Path:
        return self.folder / "kazma.log"

    @property
    def steps_file(self) -> Path:
        return self.folder / "loop-steps.txt"

    def write_config(self) -> Path:
        api = f"api:\n  tokens:\n    bench: {{token: '{API_TOKEN}', roles: [approval_requester], max_pending: 100}}\n"
        text = self.fakes.config_yaml(self.folder / "state" / "k.db", extra=api)
        text = text.replace("web: {port: 0}", f"web: {{port: {self.web_port}}}")
        text = text.replace("http: {port: 0}", f"http: {{port: {self.slack_port}}}")
        assert f"port: {self.web_port}" in text
        assert f"port: {self.slack_port}" in text
        config = self.folder / "kazma.yaml"
        config.write_text(text)
        return config

    async def start(self) -> None:
        self.folder.mkdir(parents=True)
        config = self.write_config()
        env = {**os.environ, "PYTHONPATH": self.pythonpath, "NO_PROXY": "127.0.0.1,localhost"}
        if self.steps:
            env["PYTHONPATH"] = os.pathsep.join([str(LOOP_STEPS), self.pythonpath])
            env["KAZMA_LOOP_STEPS"] = str(self.steps_file)
        with self.log.open("wb") as log:  # a file, not a pipe: reading the child's log is no work of this process
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kazma.bot.cli", "-c", str(config), "--log-format", "json", "run",
                *([] if self.paced else ["--no-pacing"]), *(["--log-level", self.log_level] if self.log_level else []),
                stdout=asyncio.subprocess.DEVNULL, stderr=log, env=env, cwd=self.folder,
            )  # fmt: skip
        if self.cpus is not None:  # before it has imported anything: every thread it starts inherits it
            os.sched_setaffinity(self.process.pid, self.cpus)

    async def ready(self) -> None:
        async with asyncio.timeout(120):
            while READY not in self.log.read_text(errors="replace"):
                if self.process is not None and self.process.returncode is not None:
                    raise RuntimeError(f"{self.tree}: kazma run ended: {self.tail()}")
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self.process is None or self.process.returncode is not None:
            return
        self.process.terminate()
        try:
            await asyncio.wait_for(self.process.wait(), 60)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid


def cards_of(fakes: Fakes, request_id: str) -> dict[str, Callable[[], bool]] | None:
    """For each platform, whether the request's card still shows its buttons (a look at that one message);
    None while the card is not up with buttons on every platform yet."""
    tg = next(
        (m.message_id for m in fakes.telegram.bot_messages(TG_CHAT) if any(request_id in str(b) for b in m.buttons)),
        None,
    )
    sl = next(
        (m.ts for m in fakes.slack.channel(SLACK_CHANNEL) if request_id in str(m.block("kazma_actions") or "")),
        None,
    )
    dc = next(
        (
            int(m["id"])
            for m in fakes.discord.channel_messages(HOME_CHANNEL_ID)
            if request_id in str(m.get("components") or "")
        ),
        None,
    )
    if tg is None or sl is None or dc is None:
        return None
    tg_id, sl_ts, dc_id = tg, sl, dc
    return {
        "telegram": lambda: bool(fakes.telegram.message(TG_CHAT, tg_id).buttons),
        "slack": lambda: fakes.slack.message(SLACK_CHANNEL, sl_ts).block("kazma_actions") is not None,
        "discord": lambda: bool(fakes.discord.messages[dc_id].get("components")),
    }


async def one_round(child: Child, http: aiohttp.ClientSession, n: int) -> Round:
    if child.paced:  # within Telegram's twenty a minute per group: see ROUND_EVERY
        await asyncio.sleep(child.next_round - time.monotonic())
        child.next_round = time.monotonic() + ROUND_EVERY
    round_cpu = cpu_ns(child.pid)
    opened = await http.post(
        f"http://127.0.0.1:{child.web_port}/api/v1/approvals",
        json={"tool": "deploy", "arguments": {"build": n}},
        headers={"Authorization": f"Bearer {API_TOKEN}", "Idempotency-Key": f"bench-{n}"},
    )
    if opened.status != 201:
        raise RuntimeError(f"{child.tree}: open answered {opened.status}: {await opened.text()}\n{child.tail()}")
    request_id = str((await opened.json())["id"])
    async with asyncio.timeout(60):
        while (shows := cards_of(child.fakes, request_id)) is None:  # noqa: ASYNC110 - the fakes are polled
            await asyncio.sleep(0.005)
    await asyncio.sleep(PRESS_GAP)  # a person's press, after the pacing slot: not a synchronisation
    slack = child.fakes.slack
    message = next(m for m in slack.channel(SLACK_CHANNEL) if request_id in str(m.block("kazma_actions") or ""))
    block = message.block("kazma_actions")
    assert block is not None
    value = str(next(e["value"] for e in block["elements"] if e["action_id"] == "kazma_approve"))
    pending = set(PLATFORMS)
    gone: dict[str, float] = {}
    child_cpu, bench_cpu = cpu_ns(child.pid), time.process_time()
    start, sent_at = time.perf_counter(), time.time()
    sent = slack.post_block_action(
        f"http://127.0.0.1:{child.slack_port}/slack/events", action_id="kazma_approve", value=value,
        user=SLACK_ADMIN, channel=SLACK_CHANNEL, message_ts=message.ts,
    )  # fmt: skip
    press = asyncio.create_task(sent)
    async with asyncio.timeout(60):
        while pending:
            for platform in tuple(pending):
                if not shows[platform]():
                    gone[platform] = time.perf_counter() - start
                    pending.discard(platform)
            if pending:
                await asyncio.sleep(0.001)
    settled = time.perf_counter() - start
    bench_window = time.process_time() - bench_cpu
    end_cpu = cpu_ns(child.pid)
    answer = await press
    if answer.status != 200:
        raise RuntimeError(f"{child.tree}: the press answered {answer.status}: {answer.body}")
    child_window, child_round = (end_cpu - child_cpu) / 1e9, (end_cpu - round_cpu) / 1e9
    return Round(settled, gone, child_window, child_round, bench_window, request_id, sent_at)


# The child's own log lines of a press, in the order they happen (its default info level logs each of them).
TIMELINE = (
    ("press read", "platform.press"),  # the Slack adapter took the request in (signature and replay guard passed)
    ("decided", "approvals.decided"),  # the decision committed
    ("first edit done", "platform.card_settled"),  # an adapter's edit call returned
    ("last edit done", "platform.card_settled"),
)


def timeline(log: Path, done: list[Round]) -> dict[str, list[float]]:
    """Seconds from the press leaving this process to each TIMELINE line of the child's log, per round."""
    seen: dict[tuple[str, str], list[float]] = {}
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        event = str(record.get("event"))
        if event not in {e for _, e in TIMELINE}:
            continue
        if event == "platform.press":  # the button's data: kz1:<request id>:<decision>
            request_id = str(record.get("data", "")).split(":")[1]
        else:
            request_id = str(record.get("request_id"))
        when = datetime.fromisoformat(str(record["timestamp"])).timestamp()
        seen.setdefault((request_id, event), []).append(when)
    out: dict[str, list[float]] = {name: [] for name, _ in TIMELINE}
    for r in done:
        for name, event in TIMELINE:
            stamps = seen.get((r.request_id, event), [])
            if stamps:
                out[name].append((max(stamps) if name == "last edit done" else min(stamps)) - r.sent_at)
    return out


def print_steps(child: Child, done: list[Round]) -> None:
    """The child's loop, step by step, over its median round (--steps): ms from the press leaving this process."""
    middle = sorted(done, key=lambda r: r.settled)[len(done) // 2]
    seen = ", ".join(f"{p} {middle.platforms[p] * 1000:.1f}" for p in PLATFORMS)
    print(f"{child.tree}: its median round, {middle.settled * 1000:.1f} ms (cards seen without buttons: {seen})")
    print(f"{'ms':>8}{'wall':>8}{'cpu':>8}  what ran")
    for line in child.steps_file.read_text().splitlines():
        began, wall, cpu, what = line.split(" ", 3)
        at = float(began) - middle.sent_at
        if 0.0 <= at <= middle.settled:
            print(f"{at * 1000:>8.2f}{float(wall):>8.3f}{float(cpu):>8.3f}  {what[:110]}")


@contextlib.asynccontextmanager
async def children(
    trees: dict[str, str], work: Path, *, paced: bool, log_level: str, steps: bool = False, cpus: set[int] | None = None
) -> AsyncIterator[list[Child]]:
    """One child per tree, each with its own three fakes, started together and ready."""
    async with contextlib.AsyncExitStack() as stack:
        made = []
        for n, (tree, pythonpath) in enumerate(trees.items()):
            fakes = await stack.enter_async_context(three_fakes())
            made.append(Child(tree, pythonpath, fakes, paced, log_level, work / f"child-{n}", steps, cpus))
        try:
            for child in made:
                await child.start()
            for child in made:
                await child.ready()
            yield made
        finally:
            for child in made:
                await child.stop()


async def machine_floor(http: aiohttp.ClientSession, cpus: set[int] | None, spaced: int = 12) -> str:
    """What one hop costs on this machine with nothing done at either end: a bare aiohttp POST answered by another
    process on 127.0.0.1 (placed as the children are), p50 over ``spaced`` POSTs each after ``FLOOR_IDLE`` s idle
    and over 200 back to back. A press reaches Kazma in one hop and each card's edit is one more, so the press ->
    cards window holds at least about two of these; on a machine whose idle CPUs wake slowly the floor says how much of
    the window is the machine's (seen here on 2026-12-03, --pin: 8.4 and 9.2 ms after idle, 0.7 back to back,
    where a socket ping-pong between two processes took 145 us across the two CPUs and 7 us on one)."""
    port = free_port()
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FLOOR_SERVER, str(port), stdout=asyncio.subprocess.DEVNULL
    )
    if cpus is not None:
        os.sched_setaffinity(server.pid, cpus)
    url = f"http://127.0.0.1:{port}/"
    try:
        async with asyncio.timeout(60):
            while True:  # until it listens
                try:
                    async with http.post(url, data=b"") as answer:
                        await answer.read()
                    break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)  # polling another process's start, not synchronising with our own

        async def one() -> float:
            began = time.perf_counter()
            async with http.post(url, data=b"x" * 600) as answer:  # about a block_actions POST's size
                await answer.read()
            return time.perf_counter() - began

        close = [await one() for _ in range(200)]
        apart = []
        for _ in range(spaced):
            await asyncio.sleep(FLOOR_IDLE)  # the idle being measured, not a synchronisation
            apart.append(await one())
    finally:
        server.kill()
        await server.wait()
    return (
        f"this machine's floor, a bare aiohttp POST answered by another process on 127.0.0.1: p50 "
        f"{statistics.median(apart) * 1000:.2f} ms after {FLOOR_IDLE} s idle, "
        f"{statistics.median(close) * 1000:.2f} ms back to back"
    )


def ms(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(v * 1000 for v in values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return statistics.median(ordered), p95, ordered[-1]


async def bench(args: argparse.Namespace) -> None:
    usable = sorted(os.sched_getaffinity(0))
    children_cpus: set[int] | None = None
    if args.pin:
        if len(usable) < 2:
            raise SystemExit("--pin needs two CPUs: one for the children, one for this process and the fakes")
        children_cpus = {usable[0]}
        os.sched_setaffinity(0, {usable[1]})
    work = Path(tempfile.mkdtemp(prefix="kazma-bench-blackbox-"))
    trees = {"this tree": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    compile_tree(REPO)
    if args.anchor:
        anchor = anchor_path(args.anchor, work / "anchor")
        compile_tree(work / "anchor" / "src")
        trees[f"anchor {args.anchor[:10]}"] = os.pathsep.join([str(anchor), str(REPO)])
    pinned = f", children on CPU {usable[0]}, fakes on CPU {usable[1]}" if children_cpus is not None else ""
    print(
        f"zero-latency fakes, {'no pacing' if args.no_pacing else f'pacing on, rounds {ROUND_EVERY} s apart'}, "
        f"log level {args.log_level or 'default'}{pinned}; "
        f"press on Slack (signed POST) -> every card without buttons; {args.rounds} rounds "
        f"per tree per run after {args.warmup} warm-up rounds, trees alternating round by round; load {load()}"
    )
    head = f"{'tree':<20}{'run':>4}{'p50 ms':>8}{'p95 ms':>8}{'max ms':>8}   {'tg / slack / dc p50 ms':<24}"
    head += f"{'kazma CPU ms: window':>21}{'/ round':>9}{'bench CPU ms':>14}{'load':>7}"
    summary: dict[str, list[Round]] = {}
    stages: dict[str, dict[str, list[float]]] = {}
    try:
        async with aiohttp.ClientSession(trust_env=False) as http:
            print(await machine_floor(http, children_cpus))
            print(head)
            for run in range(args.runs):
                async with children(
                    trees,
                    work / f"run-{run}",
                    paced=not args.no_pacing,
                    log_level=args.log_level,
                    steps=args.steps,
                    cpus=children_cpus,
                ) as kids:
                    for n in range(args.warmup):
                        for child in kids:
                            await one_round(child, http, -1 - n)
                    rounds: dict[str, list[Round]] = {child.tree: [] for child in kids}
                    for n in range(args.rounds):
                        for child in kids if n % 2 == 0 else reversed(kids):  # neither always goes first
                            rounds[child.tree].append(await one_round(child, http, n))
                    for child in kids:
                        for name, values in timeline(child.log, rounds[child.tree]).items():
                            stages.setdefault(child.tree, {}).setdefault(name, []).extend(values)
                    for tree, done in rounds.items():
                        summary.setdefault(tree, []).extend(done)
                        p50, p95, worst = ms([r.settled for r in done])
                        each = " / ".join(f"{ms([r.platforms[p] for r in done])[0]:.1f}" for p in PLATFORMS)
                        window = statistics.median(r.child_window for r in done) * 1000
                        whole = statistics.median(r.child_round for r in done) * 1000
                        mine = statistics.median(r.bench_window for r in done) * 1000
                        print(
                            f"{tree:<20}{run + 1:>4}{p50:>8.1f}{p95:>8.1f}{worst:>8.1f}   {each:<24}"
                            f"{window:>21.1f}{whole:>9.1f}{mine:>14.1f}{load():>7}"
                        )
                for child in kids if args.steps else ():  # stopped: each wrote its steps as it exited
                    print_steps(child, rounds[child.tree])
        print("all runs:")
        for tree, done in summary.items():
            p50, p95, worst = ms([r.settled for r in done])
            share = statistics.median(r.child_window / r.settled for r in done)
            print(
                f"{tree:<20}{'all':>4}{p50:>8.1f}{p95:>8.1f}{worst:>8.1f}   kazma's CPU / the window, p50: "
                f"{share:.0%} ({len(done)} rounds)"
            )
        print("the child's own log, p50 ms from the press leaving this process (its clock: time.time()):")
        for tree, named in stages.items():
            shown = (f"{name} {statistics.median(v) * 1000:.1f}" for name, v in named.items() if v)
            print(f"{tree:<20}" + ("  ".join(shown) or "(none: the log level leaves these lines out)"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="black-box press -> all three cards edited, beside an anchor tree")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--anchor", default="main", help="a git revision to run beside this tree ('' for none)")
    parser.add_argument(
        "--no-pacing", action="store_true", help="`kazma run --no-pacing`: no per-chat pacing, rounds not spaced out"
    )
    parser.add_argument(
        "--log-level",
        default="",
        help="the children's --log-level (default: kazma run's own, info; the timeline needs it)",
    )
    parser.add_argument("--pin", action="store_true", help="children on one CPU, this process and the fakes on another")
    parser.add_argument("--steps", action="store_true", help="print each tree's median round, loop step by step")
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
