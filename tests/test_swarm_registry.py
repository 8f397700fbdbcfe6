"""A swarm pattern is one registered object: a toy pattern defined and registered by this test module is parsed by
``/swarm``, listed in the help, admitted, run and recorded by the service, retried, offered to the lead and
reached from ``kazma swarm`` — and no module of the swarm names a pattern (no switch to extend)."""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from click.testing import CliRunner

from kazma.approvals import SafetyPolicy
from kazma.bot.cli.context import Context
from kazma.bot.cli.swarm_cli import swarm
from kazma.engine.agent import AgentSpec, TurnContext
from kazma.engine.fence import NOTHING
from kazma.engine.swarm.builtin_patterns import PATTERNS as BUILTIN
from kazma.engine.swarm.grammar import help_text, parse
from kazma.engine.swarm.lead_tools import swarm_tools
from kazma.engine.swarm.patterns import SwarmOutcome
from kazma.engine.swarm.registry import PatternClash, PatternRun, SwarmPattern, register, registered, unregister
from kazma.engine.swarm.roles import Role, required_role
from kazma.engine.swarm.syntax import Arguments, GrammarError, RequestFields, Route, StartCommand
from kazma.engine.swarm.types import SwarmRequest, TaskStatus
from tests.approvals_support import approval_service
from tests.swarm_rig import config, rig
from tests.swarm_support import ScriptedWorker

REPO = Path(__file__).resolve().parent.parent
WORKERS = ("researcher", "builder")
CFG = """
agents:
  workers:
    researcher: {system_prompt: "You are researcher."}
    builder: {system_prompt: "You are builder."}
pipelines: {}
tools: {dispatch_swarm: read}
"""


@dataclass(frozen=True)
class EchoCommand(StartCommand):
    verb: ClassVar[str] = "echo"
    pattern: ClassVar[str] = "echo_twice"
    worker: str
    prompt: str

    def request_fields(self) -> RequestFields:
        return {"workers": (self.worker,), "prompt": self.prompt}


def _parse_echo(args: Arguments, rest: str, opts: dict[str, str]) -> EchoCommand:
    token, prompt, opts = args.word_then_task(rest, opts)
    args.check_worker(token.lower())
    return EchoCommand(token.lower(), args.prompt(prompt), **args.start(opts))


async def _run_echo(run: PatternRun) -> SwarmOutcome:
    """Ask the one worker twice; the answers joined are the result."""
    worker = run.workers[0]
    await run.mark(f"echoing ({worker.name})")
    results = [await run.call(worker, run.request.prompt, NOTHING) for _ in range(2)]
    status = TaskStatus.SUCCEEDED if all(r.ok for r in results) else TaskStatus.FAILED
    return SwarmOutcome(status, " | ".join(r.output for r in results), results, {"echoes": len(results)})


ECHO = SwarmPattern(
    EchoCommand,
    arguments="<worker> <task>",
    needs="a worker and a task",
    summary="ask one worker the same task twice",
    parse=_parse_echo,
    run=_run_echo,
)


@pytest.fixture
def echo() -> Iterator[SwarmPattern]:
    register(ECHO)
    try:
        yield ECHO
    finally:
        unregister(ECHO.name)


def p(text: str) -> object:
    return parse(text, workers=WORKERS, pipelines={})


def test_the_grammar_reads_a_registered_pattern_with_its_own_arguments(echo: SwarmPattern) -> None:
    assert p("echo Builder say it -> telegram:-5") == EchoCommand("builder", "say it", route=Route("telegram", "-5"))
    assert p("echo --deadline 30 builder say it") == EchoCommand("builder", "say it", deadline=30)
    assert p("echo builder --expect json say it") == EchoCommand("builder", "say it", expect="json")
    with pytest.raises(GrammarError) as missing:
        p("echo builder")
    assert missing.value.message == "echo needs a worker and a task: /swarm echo <worker> <task>"
    with pytest.raises(GrammarError, match="unknown option '--strategy'"):
        p("echo --strategy vote builder say it")  # fanout's option is fanout's
    with pytest.raises(GrammarError, match="unknown worker 'nobody'"):
        p("echo nobody say it")
    assert required_role(EchoCommand("builder", "x")) is Role.OPERATOR
    line = next(line for line in help_text().splitlines() if line.startswith("/swarm echo "))
    assert "/swarm echo <worker> <task>" in line
    assert line.endswith("(steering, admin) ask one worker the same task twice")


def test_an_unregistered_pattern_is_an_unknown_subcommand() -> None:
    with pytest.raises(GrammarError, match="unknown subcommand 'echo'"):
        p("echo builder say it")
    assert "/swarm echo" not in help_text()


async def test_the_service_admits_runs_records_and_retries_it(echo: SwarmPattern, tmp_path: Path) -> None:
    builder = ScriptedWorker("builder")
    async with rig(tmp_path / "s.db", {"researcher": ScriptedWorker("researcher"), "builder": builder}, config()) as r:
        answer = await r.send("echo builder say it")
        assert answer.endswith("started (echo_twice). Check it with /swarm status " + answer.split()[2])
        record = await r.ended(answer)
        assert (record.pattern, record.status) == ("echo_twice", TaskStatus.SUCCEEDED)
        assert record.result is not None
        assert record.result["output"] == "builder ok | builder ok"
        assert record.result["details"] == {"echoes": 2}
        assert [prompt for prompt, _ in builder.seen] == ["say it", "say it"]
        assert len(await r.service.store.calls(record.id)) == 2
        status = await r.send(f"status {record.id}")
        assert f"swarm task {record.id}: succeeded (echo_twice, by telegram:111)" in status
        retried = await r.send(f"retry {record.id}")
        again = await r.service.wait(retried.split()[-1], 30)
        assert again is not None
        assert (again.pattern, again.status) == ("echo_twice", TaskStatus.SUCCEEDED)
        assert len(builder.seen) == 4


async def test_the_service_refuses_a_pattern_nobody_registered(tmp_path: Path) -> None:
    async with rig(tmp_path / "s.db", {"builder": ScriptedWorker("builder")}, config()) as r:
        with pytest.raises(ValueError, match="unknown swarm pattern 'echo_twice'"):
            await r.service.submit(SwarmRequest("echo_twice", ("builder",), "say it", "telegram:111"))
        assert await r.service.store.list() == []


async def test_the_lead_is_offered_it_and_may_start_it(echo: SwarmPattern, tmp_path: Path) -> None:
    cfg = config(CFG)
    workers = {"researcher": ScriptedWorker("researcher"), "builder": ScriptedWorker("builder")}
    async with rig(tmp_path / "s.db", workers, cfg) as r, approval_service(tmp_path / "ap.db", config=cfg) as ap:
        dispatch, _ = swarm_tools(r.service, SafetyPolicy(ap))
        assert "echo_twice" in dispatch.spec.parameters["properties"]["pattern"]["enum"]
        ctx = TurnContext("telegram:-1001", AgentSpec("kazma", "lead", is_lead=True), "telegram:111")
        started = await dispatch.handler({"pattern": "echo_twice", "task": "say it", "workers": ["builder"]}, ctx)
        assert started.ok, started.error
        refused = await dispatch.handler({"pattern": "echo_thrice", "task": "say it", "workers": ["builder"]}, ctx)
        assert not refused.ok
        assert "unknown pattern 'echo_thrice'" in (refused.error or "")
        (record,) = await r.service.store.list()
        assert (await r.ended(f"swarm task {record.id} started")).pattern == "echo_twice"


def test_kazma_swarm_reaches_it_without_a_command_of_its_own(echo: SwarmPattern, tmp_path: Path) -> None:
    path = tmp_path / "kazma.yaml"
    path.write_text(CFG, encoding="utf-8")
    result = CliRunner().invoke(
        swarm, ["--parse-only", "echo", "--deadline", "30", "builder", "say", "it"], obj=Context(path)
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {
        "verb": "echo",
        "expect": None,
        "deadline": 30,
        "worker": "builder",
        "prompt": "say it",
        "route": None,
    }
    assert "echo" in CliRunner().invoke(swarm, ["--help"]).output


def test_a_name_or_verb_already_taken_is_refused(echo: SwarmPattern) -> None:
    @dataclass(frozen=True)
    class Shadow(EchoCommand):
        pattern: ClassVar[str] = "dispatch"

    with pytest.raises(PatternClash, match="dispatch"):
        register(SwarmPattern(Shadow, "<task>", "a task", "x", parse=_parse_echo, run=_run_echo))
    with pytest.raises(PatternClash, match="echo"):
        register(SwarmPattern(EchoCommand, "<task>", "a task", "x", parse=_parse_echo, run=_run_echo))
    assert registered() == (*BUILTIN, ECHO)


@pytest.mark.parametrize(
    "module",
    [
        "engine/swarm/grammar.py",
        "engine/swarm/service.py",
        "engine/swarm/commands.py",
        "engine/swarm/lead_tools.py",
        "engine/swarm/roles.py",
    ],
)
def test_no_module_around_the_patterns_names_one(module: str) -> None:
    """The switches are gone: the grammar, the service, the commands, the lead's tool, the roles and the CLI find
    patterns in the registry; none of them holds a pattern's name or verb, nor its command class."""
    names = {word for pattern in BUILTIN for word in (pattern.name, pattern.verb)}
    classes = {pattern.command.__name__ for pattern in BUILTIN}
    tree = ast.parse((REPO / module).read_text(encoding="utf-8"))
    found = sorted(
        {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in names}
        | {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id in classes}
        | {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr.isupper()
           and node.attr in {"DISPATCH", "BROADCAST", "PIPELINE", "FAN_OUT", "CONSULT", "CONDITIONAL"}}
    )  # fmt: skip
    assert found == []
