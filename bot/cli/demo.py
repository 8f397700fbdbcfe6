"""``kazma demo``: the whole loop in a terminal, with no tokens and no model.

A scripted scenario (labelled as such) plays the lead and two sub-agents: a
request, a plan, visible ``@`` dispatches, a dangerous ``shell`` call with its
approval card, a press, and the outcome. Everything else — store, approvals,
executor, tools, the bus — is the real thing, in a temporary directory.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import signal
import socket
import tempfile
import webbrowser
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from kazma.adapters.contract import Inbound
from kazma.adapters.terminal import TerminalAdapter
from kazma.adapters.web import WebAdapter
from kazma.approvals import ApprovalStore
from kazma.approvals.model import Decision
from kazma.bot.app import build_app
from kazma.bot.console.server import WebServer
from kazma.bot.console.signin import LocalLogin
from kazma.config import LoadedConfig, load_config_text
from kazma.engine.executor import ActionKind
from kazma.engine.model import ScriptStep
from kazma.engine.scenario import DEMO_LABEL, PerAgentScript, agent_prompts
from kazma.engine.swarm.synthesis import REFINER_INSTRUCTION
from kazma.engine.types import Message, ModelReply, ToolCall

REQUEST = "@kazma please write a tiny hello-world script and check that it runs"
SHELL_COMMAND = "echo 'echo hello, world' > hello.sh && sh hello.sh"

PLAN = {
    "goal": "a hello-world script that runs",
    "steps": [
        {
            "index": 1,
            "title": "Find the simplest portable way",
            "assignee": "researcher",
            "input": "Find the simplest portable way to print 'hello, world' from a shell script.",
        },
        {
            "index": 2,
            "title": "Write and run it",
            "assignee": "builder",
            "input": "Write hello.sh as the research says and run it once:{{step_1.output_summary}}",
        },
    ],
}


def _last(messages: Sequence[Message], role: str) -> str:
    for message in reversed(messages):
        if message.get("role") == role:
            return str(message.get("content") or "")
    return ""


def _builder_report(messages: Sequence[Message]) -> ModelReply:
    result = _last(messages, "tool")
    if result.startswith("Not run:"):
        return ModelReply(content=f"I did not write the script: {result.removeprefix('Not run: ')}")
    printed = "hello, world" if "hello, world" in result else "something unexpected (see the tool output)"
    return ModelReply(content=f"hello.sh is written and ran once; it printed: {printed}")


def _lead_report(messages: Sequence[Message]) -> ModelReply:
    report = _last(messages, "user")
    worked = "printed: hello, world" in report
    verdict = "The script works." if worked else "The plan ended without a working script; see above."
    return ModelReply(content=f"Done: the researcher and the builder finished their steps. {verdict}")


# What the lead says once its script is done, to whatever it is asked: how to leave the demo for a real model.
CONNECT_A_MODEL = (
    "That was the scripted demo: no model is connected, so I have nothing more to say. To work with a real "
    "model, run `kazma init` (it writes kazma.yaml with you as the approver), point model.base_url at an "
    "OpenAI-compatible server (Ollama: http://127.0.0.1:11434/v1; OpenAI, vLLM, LM Studio and OpenRouter work "
    "too) and set KAZMA_MODEL and KAZMA_MODEL_API_KEY if it needs them, then `kazma doctor` and `kazma run`. "
    "Meanwhile the swarm commands still run on the scripted workers: try `/swarm help`, or "
    "`/swarm pipeline quick write a haiku`."
)
# The demo's workers after the scenario: one scripted line each, about the task they were given.
_WORKER_LINES = {
    "researcher": "Notes on “{task}”: two sources agree on the simplest way.",
    "refiner": "A specification for “{task}”: one input, one output, and a check that it worked.",
    "builder": "Built “{task}” in the workspace.",
    "validator": "Checked “{task}” against the request: nothing is missing.",
}


def _task_of(messages: Sequence[Message]) -> str:
    """The first line of the task a worker was handed, short enough to quote."""
    text = _last(messages, "user").strip().splitlines()
    first = text[0] if text else "the task"
    return first if len(first) <= 60 else first[:59] + "…"


def _worker_reply(name: str) -> Callable[[Sequence[Message]], ModelReply]:
    line = _WORKER_LINES.get(name, "Did “{task}” (scripted).")

    def reply(messages: Sequence[Message]) -> ModelReply:
        return ModelReply(content=f"{line.format(task=_task_of(messages))} (scripted {name}; no model was called)")

    return reply


def _synthesis(messages: Sequence[Message]) -> ModelReply:
    if messages and messages[0].get("content") == REFINER_INSTRUCTION:
        # the pipeline refiner: the scripted report is the last stage's answer, labelled
        answers = re.findall(r">>>\n(.*?)<<<end-untrusted-data", _last(messages, "user"), flags=re.DOTALL)
        final = answers[-1].strip() if answers else ""
        return ModelReply(content=f"{final}\n(report by the scripted refiner: no model was called)")
    return ModelReply(content="The workers agree (a scripted synthesis: no model was called).")


def scenario(prompts: dict[str, str]) -> PerAgentScript:
    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [
            ModelReply(content=None, tool_calls=(ToolCall("plan-1", "write_plan", PLAN, json.dumps(PLAN)),)),
            ModelReply(content="Plan made: @researcher looks up the portable way, then @builder writes and runs it."),
            _lead_report,
        ],
        "researcher": [
            ModelReply(content="A POSIX sh script with a single `echo 'hello, world'` line is the most portable."),
        ],
        "builder": [
            ModelReply(
                content=None,
                tool_calls=(
                    ToolCall("shell-1", "shell", {"command": SHELL_COMMAND}, json.dumps({"command": SHELL_COMMAND})),
                ),
            ),
            _builder_report,
        ],
    }
    after = {name: _worker_reply(name) for name in prompts if name != "kazma"}
    after["kazma"] = lambda _messages: ModelReply(content=CONNECT_A_MODEL)
    return PerAgentScript(scripts, prompts, label=DEMO_LABEL, after=after, otherwise=_synthesis)


def demo_config(root: Path, web_port: int = 8765, *, web: bool = True) -> LoadedConfig:
    """One demo person, ``demo``: ``cli:demo`` at this terminal and, with the console, ``web:demo`` in the
    browser — one person at two doors (so the swarm's steering is not shared between people), and every
    decision names them."""
    doors = "{web: demo, cli: demo}" if web else "{cli: demo}"
    # The store one folder down: its siblings (the workspaces, the decision keys) stay inside ``root`` too.
    return load_config_text(
        f"store: {{path: '{root / 'state' / 'kazma.db'}'}}\n"
        f"web: {{port: {web_port}, public_url: 'http://127.0.0.1:{web_port}'}}\n"
        f"people: {{demo: {doors}}}\n"
        "approvals: {approvers: [demo], deadline_seconds: 300}\n",
        environ={},
    )


def _free_port() -> int:
    """A port to print in card links before the server binds it (port 0 would be unknown until then)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def run_demo(
    *,
    out: IO[str],
    interactive: bool | None = None,
    decision: Decision = Decision.APPROVE,
    web: bool = False,
    web_port: int = 8765,
    open_browser: bool = False,
    linger: bool = False,
) -> bool:
    """Play the scenario; True when the plan finished, the lead reported and every card settled.

    With ``web`` the conversation runs in the web console (printed URL and token)
    and the card shows in the browser and in this terminal; the first press on
    either decides. ``linger`` keeps the console up afterwards until Ctrl-C.
    """
    # Ctrl-C and SIGTERM end the demo as `kazma run` ends: everything stopped, the temporary directory (its store,
    # its decision key) removed, and said. SIGTERM killed it where it stood, leaving that directory in /tmp, and a
    # Ctrl-C left without a word, also in the middle of the scenario.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (a test's): KeyboardInterrupt as before
            continue
        handled.append(sig)
    try:
        with tempfile.TemporaryDirectory(prefix="kazma-demo-") as tmp:
            ended = await _play(
                Path(tmp), out=out, interactive=interactive, decision=decision, web=web, web_port=web_port,
                open_browser=open_browser, linger=linger, stop=stop,
            )  # fmt: skip
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
    if stop.is_set():
        how = "stopped" if ended else "interrupted before the scenario ended"
        out.write(f"\nkazma demo {how}: everything it started is stopped and its temporary directory removed\n")
        out.flush()
    return ended


async def _until(done: asyncio.Event, stop: asyncio.Event) -> bool:
    """Wait for ``done`` or ``stop``, whichever comes first: True when it was ``done``."""
    waits = [asyncio.create_task(done.wait()), asyncio.create_task(stop.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    return done.is_set()


async def _play(
    root: Path,
    *,
    out: IO[str],
    interactive: bool | None,
    decision: Decision,
    web: bool,
    web_port: int,
    open_browser: bool,
    linger: bool,
    stop: asyncio.Event,
) -> bool:
    """The demo in ``root``; False when ``stop`` came before the scenario ended."""
    web_port = web_port or _free_port()
    loaded = demo_config(root, web_port, web=web)
    prompts = agent_prompts(loaded.config)
    provider = scenario(prompts)
    console = WebAdapter() if web else None
    terminal = TerminalAdapter(
        out=out,
        interactive=interactive,
        auto=None if web else decision,
        # at the end of input (Ctrl-D) at the prompt: the console decides with web, nothing else can without
        end_of_input=None if web else Decision.DENY,
        # no console is served in terminal mode: the card says so instead of linking nowhere
        link_note=None if web else "not served by `kazma demo --terminal` (the whole call is shown above)",
    )
    app = await build_app(loaded, provider=provider, adapters=[terminal], web=console)
    server = None
    local = LocalLogin("demo")  # the demo's browser signs in with a link printed here, once
    if console is not None:
        server = WebServer(
            app.console, console, host="127.0.0.1", port=web_port, token_path=root / "web-token",
            operator_token=secrets.token_urlsafe(24), local_login=local,
        )  # fmt: skip
    out.write(f"kazma demo — model: {provider.label}\n")
    out.write(f"store: {loaded.config.store.path} (temporary)\n")
    finished = asyncio.Event()
    app.conversations.listeners.append(lambda action: finished.set() if action.kind is ActionKind.FINISHED else None)
    await app.start()
    try:
        if server is not None and console is not None:
            await server.start()
            assert server.auth is not None
            out.write(
                f"\nweb console: {server.url}{local.path} — signs one browser in as 'demo' (kazma demo's local "
                "identity, not a proof: a real console signs people in with passkeys)\n"
                "approve the card there (or type a/d here when asked)\n\n"
            )
            out.flush()
            if open_browser:
                webbrowser.open(f"{server.url}{local.path}")
            await console.say("demo", REQUEST)
        else:
            out.write(f"\n[you] {REQUEST}\n")
            await app.on_inbound(
                Inbound(
                    platform="cli",
                    chat=terminal.chat,
                    message_id="you-1",
                    author="cli:you",
                    author_name="you",
                    text=REQUEST,
                    mentions=("kazma",),
                )
            )
        async with asyncio.timeout(600):  # not wait_for: see kazma.config.waits
            if not await _until(finished, stop):
                return False
        await app.conversations.drain()
        for request in await app.service.store.requests():
            await _wait_settled(app.service.store, request.id)
        if linger and server is not None:
            out.write(f"\nthe demo is done; the console stays up at {server.url} — press Ctrl-C to leave\n")
            out.flush()
            await stop.wait()
        return True
    finally:
        if server is not None:
            await server.stop()
        await app.stop()


async def _wait_settled(store: ApprovalStore, request_id: str) -> None:
    """Every card of the request shows its outcome (a condition, polled with a deadline)."""
    async with asyncio.timeout(30):
        while True:
            cards = await store.cards(request_id)
            if cards and all(c.settled_at is not None for c in cards):
                return
            await asyncio.sleep(0.05)
