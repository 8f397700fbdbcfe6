"""`kazma run` start-up and idle memory, side by side with an anchor tree. Prints numbers; asserts nothing.

Three wire-level fakes (Telegram, Slack, Discord from tests/fakes) run in this
process; `kazma -c kazma.yaml --log-format json run` runs as a real child against
them, no MCP server and no API token configured. For each tree (this checkout,
and ``--anchor REV``'s tree exported by ``git archive`` and put first on
PYTHONPATH as ``kazma.<layer>`` links, the way scripts/check makes .typecheck),
three cases, ``--runs`` times each, interleaved:

* ready: spawn → the ``kazma is running; web console at …`` line (printed right
  after the ``web.started`` event: the web server answers ``/healthz`` from then),
  and the CPU seconds the child had used by then (user + system, read from
  ``/proc`` at that line: on a loaded machine wall time measures the neighbours,
  CPU time much less);
* ready with ``--orphans`` pending requests a killed process left (opened into a
  template store once, copied for each run): the same moment;
* idle RSS: ``VmRSS`` of the child ``--idle`` seconds after ready, and which
  heavy packages it had imported (read from the child itself on SIGUSR1).

Each tree's modules are compiled to bytecode first, as ``pip install`` does
(and as the first start of a checkout does, unless PYTHONDONTWRITEBYTECODE is
set, as it is on some machines: then every start compiled Kazma afresh, and
the bench measured the compiler).

Then RSS per component: a fresh interpreter imports the packages the child held,
one at a time in the order below, and prints what each added (a package another
one pulled in first is counted with that one).

    PYTHONPATH=. python bench/idle_rss.py [--runs 3] [--orphans 10000] [--anchor main] [--tree HEAD]
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kazma.approvals import ApprovalService, ApprovalStore
from kazma.approvals.checkpointer import Checkpointer
from kazma.bot.keys import load_audit_signer, load_decision_keyring
from kazma.bot.store import open_store
from kazma.config import load_config
from tests.platforms_support import Fakes, three_fakes

REPO = Path(__file__).resolve().parent.parent
# Where the orphans were asked: the console's conversation. A restart tells each orphan's conversation; told in
# a paced chat, 10,000 notices would take hours and measure the pacing, not the start.
CONVERSATION = "web:console"
LAYERS = ("config", "approvals", "adapters", "engine", "bot")
# What a `kazma run` may import, heaviest first among the optional ones; the probe imports them in this order.
# twisted and rich come with the dev extra (matrix-synapse), and structlog imports these parts of them whenever
# they are installed: listed before it, so what a production install does not load shows apart. So do PyNaCl
# (discord.py's voice, kept out by config/registry/discord.py), bcrypt (cryptography's SSH key loader) and greenlet
# (Playwright's; structlog's threadlocal imports it, kept out by bot/lean_imports.py).
DEV_ONLY = (
    "twisted.python.log", "twisted.python.failure", "zope.interface", "rich.console", "rich.traceback", "nacl.secret",
    "bcrypt", "greenlet",
)  # fmt: skip
COMPONENTS = (
    *DEV_ONLY, "yaml", "pydantic", "structlog", "aiosqlite", "cryptography", "aiohttp", "prometheus_client", "httpx",
    "jsonschema", "telegram", "discord", "slack_bolt", "slack_sdk", "mcp", "mautrix", "psycopg", "psycopg_pool",
    "anyio", "starlette", "webauthn",
)  # fmt: skip
KAZMA_ITSELF = ("kazma.bot.app", "kazma.bot.console.server")  # the rest: Kazma's own modules
# First, where the tree has it: structlog and httpx as `kazma run` imports them (without the dev extra's rich and
# Twisted), so the probe loads what the child loaded. Only a tree that has the file: the editable install's
# finder would otherwise find this checkout's copy for an older tree.
LEAN = ("kazma.bot.lean_imports", Path("bot") / "lean_imports.py")

# Run inside the child instead of `python -m kazma.bot.cli`: on SIGUSR1 it writes the top-level packages it
# has imported to the file named by KAZMA_BENCH_MODULES, then goes on serving.
CHILD = """
import os, signal, sys
def dump(*_):
    with open(os.environ["KAZMA_BENCH_MODULES"], "w") as out:
        out.write("\\n".join(sorted({m.split(".")[0] for m in sys.modules})))
signal.signal(signal.SIGUSR1, dump)
from kazma.bot.cli import main
main(sys.argv[1:], prog_name="kazma")
"""

PROBE = """
import importlib, json, sys
def rss():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) for l in status if l.startswith("VmRSS:")) * 1024
out = {"python": rss()}
for name in sys.argv[1:]:
    before = rss()
    try:
        importlib.import_module(name)
    except ImportError:
        continue
    out[name] = rss() - before
print(json.dumps(out))
"""


def anchor_path(rev: str, into: Path) -> Path:
    """``rev``'s tree as an importable ``kazma`` namespace: exported, and linked as scripts/check does."""
    src, path = into / "src", into / "path"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout  # noqa: S603, S607
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)  # noqa: S603, S607
    (path / "kazma").mkdir(parents=True)
    for layer in LAYERS:
        (path / "kazma" / layer).symlink_to(src / layer)
    return path


def compile_tree(root: Path) -> None:
    """Bytecode for every module of the tree at ``root`` (a checkout, or an exported revision)."""
    for layer in LAYERS:
        if not compileall.compile_dir(str(root / layer), quiet=1):
            raise RuntimeError(f"{root / layer} does not compile")


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (every thread)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) * 1024


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


async def make_orphans(config: Path, count: int) -> None:
    """``count`` pending requests opened as a killed `kazma run` leaves them (no waiter, no owner, no card): with
    its keys, so its commits are sealed, and its audit events signed by a checkpoint, as its checkpointer signs
    them within a fiftieth of a second. (Opened without keys, every start judged 10,000 events no seal vouched
    for and logged audit.unvouched_events: the store of a tampering, not of a crash.)"""
    loaded = load_config(config, environ={})
    conn = await open_store(loaded.config)
    signer = load_audit_signer(loaded.config)
    store = ApprovalStore(conn, keyring=load_decision_keyring(loaded.config), audit=signer)
    service = ApprovalService(store, loaded.config)
    try:
        await store.start_chain()
        for start in range(0, count, 200):
            await asyncio.gather(
                *(
                    service.open("shell", {"command": f"rm -rf /srv/old-{n}"}, "agent:builder", CONVERSATION)
                    for n in range(start, min(count, start + 200))
                )
            )
        judged = await Checkpointer(store, signer).sign()
        assert not judged.unvouched, judged.unvouched[:5]
    finally:
        await conn.close()


async def one_run(config: Path, pythonpath: str, *, idle: float) -> tuple[float, float, int, list[str], list[str]]:
    """(seconds to ready, CPU seconds to ready, idle RSS bytes, top-level packages imported, the log's events up to
    ready)."""
    modules = config.parent / "modules.txt"
    env = {**os.environ, "PYTHONPATH": pythonpath, "NO_PROXY": "127.0.0.1,localhost"}
    env["KAZMA_BENCH_MODULES"] = str(modules)
    start = time.perf_counter()
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, "-c", str(config), "--log-format", "json", "run",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    assert child.stderr is not None
    events: list[str] = []
    try:
        async with asyncio.timeout(600):
            while True:
                line = (await child.stderr.readline()).decode()
                if not line:
                    raise RuntimeError(f"kazma run ended before it was ready: {events[-5:]}")
                if line.startswith("kazma is running"):
                    ready = time.perf_counter() - start
                    cpu = cpu_of(child.pid)
                    break
                if line.startswith("{"):
                    record = json.loads(line)
                    events.append(f"{time.perf_counter() - start:6.3f} {record.get('event')}")
                else:
                    events.append(line.rstrip())

        async def drain() -> None:
            assert child.stderr is not None
            while await child.stderr.readline():
                pass

        draining = asyncio.create_task(drain())  # the orphans' log lines after ready must not fill the pipe
        await asyncio.sleep(idle)  # a bench's idle time, not a synchronisation: the process is left alone
        rss = rss_of(child.pid)
        modules.unlink(missing_ok=True)
        child.send_signal(signal.SIGUSR1)
        async with asyncio.timeout(10):
            while not modules.exists() or not modules.read_text():  # noqa: ASYNC110 - another process writes it
                await asyncio.sleep(0.02)
        imported = modules.read_text().split()
    except TimeoutError:
        print("\n".join(events[-20:]), file=sys.stderr)
        raise
    finally:
        if child.returncode is None:  # killed: a stop may wait on work this bench does not measure
            child.kill()
        await asyncio.wait_for(child.wait(), 60)
    draining.cancel()
    return ready, cpu, rss, imported, events


def fresh_state(template: Path | None, into: Path, fakes: Fakes) -> Path:
    if into.exists():
        shutil.rmtree(into)
    if template is not None:
        shutil.copytree(template, into)
    else:
        into.mkdir(parents=True)
    config = into / "kazma.yaml"
    config.write_text(fakes.config_yaml(into / "state" / "k.db"))
    return config


async def bench(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="kazma-bench-start-"))
    # this checkout as it is, or as revision --tree is (so the checkout may change while the bench runs)
    trees = {"this tree": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    compile_tree(REPO)
    roots = {"this tree": REPO}
    if args.tree:
        trees = {f"tree {args.tree[:10]}": os.pathsep.join([str(anchor_path(args.tree, work / "tree")), str(REPO)])}
        compile_tree(work / "tree" / "src")
        roots = {f"tree {args.tree[:10]}": work / "tree" / "src"}
    if args.anchor:
        anchor = anchor_path(args.anchor, work / "anchor")
        trees[f"anchor {args.anchor[:10]}"] = os.pathsep.join([str(anchor), str(REPO)])
        compile_tree(work / "anchor" / "src")
        roots[f"anchor {args.anchor[:10]}"] = work / "anchor" / "src"
    try:
        async with three_fakes() as fakes:
            template = None
            if args.orphans:
                template = work / "template"
                config = fresh_state(None, template, fakes)
                began = time.perf_counter()
                await make_orphans(config, args.orphans)
                print(f"{args.orphans} orphans made in {time.perf_counter() - began:.1f} s")
            results: dict[tuple[str, str], list[tuple[float, float, int, str]]] = {}
            imported: dict[str, list[str]] = {}
            for run in range(args.runs):
                for tree, pythonpath in trees.items():  # interleaved: the machine's load falls on both alike
                    for case, state in (("3 platforms", None), (f"+{args.orphans} orphans", template)):
                        if case.startswith("+") and state is None:
                            continue
                        config = fresh_state(state, work / "run", fakes)
                        ready, cpu, rss, mods, events = await one_run(config, pythonpath, idle=args.idle)
                        results.setdefault((tree, case), []).append((ready, cpu, rss, load()))
                        imported[tree] = mods
                        if args.timeline and run == 0:
                            print(f"-- {tree}, {case}: timeline (s since spawn)")
                            print("\n".join(events))
            print(
                f"\n{'tree':<22}{'case':<22}{'ready s (3 runs)':<26}{'CPU s to ready':<26}"
                f"{'idle RSS MB':<16}load (1 min)"
            )
            for (tree, case), values in results.items():
                readies = " ".join(f"{r:.3f}" for r, _, _, _ in values)
                cpus = " ".join(f"{c:.2f}" for _, c, _, _ in values)
                rsses = " ".join(f"{m / 1e6:.0f}" for _, _, m, _ in values)
                loads = " ".join(x for _, _, _, x in values)
                median = statistics.median(r for r, _, _, _ in values)
                cpu_median = statistics.median(c for _, c, _, _ in values)
                print(
                    f"{tree:<22}{case:<22}{readies + f' (med {median:.3f})':<26}"
                    f"{cpus + f' (med {cpu_median:.2f})':<26}{rsses:<16}{loads}"
                )
            print("\nRSS per component (MB added when imported in this order; what the child held)")
            for tree, pythonpath in trees.items():
                held = [c for c in COMPONENTS if c.split(".")[0] in imported.get(tree, [])]
                env = {**os.environ, "PYTHONPATH": pythonpath}
                lean = [LEAN[0]] if (roots[tree] / LEAN[1]).exists() else []
                probe = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", PROBE, *lean, *held, *KAZMA_ITSELF, stdout=asyncio.subprocess.PIPE, env=env
                )
                out, _ = await probe.communicate()
                sizes: dict[str, int] = json.loads(out)
                line = "  ".join(
                    f"{name}{'*' if name in DEV_ONLY else ''} {size / 1e6:.1f}" for name, size in sizes.items()
                )
                dev = sum(size for name, size in sizes.items() if name in DEV_ONLY)
                absent = sorted({c.split(".")[0] for c in COMPONENTS if c not in held})
                print(f"{tree}: {line}\n    not imported: {', '.join(absent) or '-'}")
                print(f"    *dev extra only: {dev / 1e6:.1f} MB of the RSS a production install does not load")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="kazma run: ready time and idle RSS, beside an anchor tree")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--orphans", type=int, default=10_000, help="pending orphans for the second case (0: skip)")
    parser.add_argument("--anchor", default="", help="a git revision to run beside this tree (e.g. main)")
    parser.add_argument("--tree", default="", help="measure this git revision instead of the checkout as it is")
    parser.add_argument("--idle", type=float, default=3.0, help="seconds after ready before RSS is read")
    parser.add_argument("--timeline", action="store_true", help="print each tree's log events up to ready once")
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
