"""The /swarm grammar, its role rules and the `kazma swarm` CLI that shares them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from kazma.bot.cli.context import Context
from kazma.bot.cli.swarm_cli import CLI_ONLY, swarm
from kazma.config.limits import MAX_WORKERS as MAX_LIST_WORKERS
from kazma.config.models import KazmaConfig
from kazma.engine.swarm.builtin_patterns import (
    BroadcastCommand,
    ConditionalCommand,
    ConsultCommand,
    DispatchCommand,
    FanOutCommand,
    PipelineCommand,
)
from kazma.engine.swarm.grammar import (
    USAGES,
    VERBS,
    ApproveCommand,
    BreakerResetCommand,
    CancelCommand,
    ConfigCommand,
    HelpCommand,
    HistoryCommand,
    ListCommand,
    MetricsCommand,
    RejectCommand,
    RetryCommand,
    StatusCommand,
    TasksCommand,
    WorkersCommand,
    help_text,
    parse,
)
from kazma.engine.swarm.lead_tools import DispatchSwarmArgs
from kazma.engine.swarm.limits import MAX_PROMPT_BYTES
from kazma.engine.swarm.patterns import Aggregation
from kazma.engine.swarm.roles import (
    SHARED_OPERATORS_HINT,
    RefusalReason,
    Role,
    authorize,
    human_operators,
    required_role,
)
from kazma.engine.swarm.syntax import Access, GrammarError, Route, SwarmCommand
from kazma.engine.swarm.types import Pattern

WORKERS = ("researcher", "refiner", "builder", "validator")
PIPELINES = {"standard": ["researcher", "refiner", "builder", "validator"], "quick": ["researcher", "builder"]}
MANY = tuple(f"w{i:02d}" for i in range(40))


def p(text: str, workers: tuple[str, ...] = WORKERS) -> SwarmCommand:
    return parse(text, workers=workers, pipelines=PIPELINES)


def error(text: str, workers: tuple[str, ...] = WORKERS) -> GrammarError:
    with pytest.raises(GrammarError) as caught:
        p(text, workers)
    return caught.value


# ---------------------------------------------------------------- well-formed

TG = Route("telegram", "-1001234567890")

WELL_FORMED: list[tuple[str, SwarmCommand]] = [
    ("", HelpCommand()),
    ("   \n ", HelpCommand()),
    ("help", HelpCommand()),
    ("HELP", HelpCommand()),
    ("status", StatusCommand()),
    ("status t-1234", StatusCommand("t-1234")),
    ("status " + "a" * 32, StatusCommand("a" * 32)),
    ("list", ListCommand()),
    ("history", HistoryCommand()),
    ("workers", WorkersCommand()),
    ("tasks", TasksCommand()),
    ("tasks --worker Builder", TasksCommand("builder")),
    ("config", ConfigCommand()),
    ("dispatch builder write a script", DispatchCommand("builder", "write a script")),
    ("dispatch auto find sources", DispatchCommand(None, "find sources")),
    ("dispatch AUTO find sources", DispatchCommand(None, "find sources")),
    ("Dispatch Builder x", DispatchCommand("builder", "x")),
    ("dispatch\nbuilder\nline one\n  line two  ", DispatchCommand("builder", "line one\n  line two")),
    ("dispatch builder say \"hi\" and 'bye'", DispatchCommand("builder", "say \"hi\" and 'bye'")),
    ("broadcast summarise the README", BroadcastCommand("summarise the README")),
    ("pipeline standard build it", PipelineCommand(tuple(PIPELINES["standard"]), "build it", preset="standard")),
    ("pipeline quick build it", PipelineCommand(("researcher", "builder"), "build it", preset="quick")),
    ("pipeline researcher,builder build it", PipelineCommand(("researcher", "builder"), "build it")),
    ("pipeline builder build it", PipelineCommand(("builder",), "build it")),
    ("fanout researcher,validator check it", FanOutCommand(("researcher", "validator"), "check it")),
    ("fanout builder check it", FanOutCommand(("builder",), "check it")),
    ("consult refiner,builder which is better?", ConsultCommand(("refiner", "builder"), "which is better?")),
    (
        "fanout researcher,validator --strategy vote --expect json --deadline 60 check it",
        FanOutCommand(("researcher", "validator"), "check it", "vote", expect="json", deadline=60),
    ),
    (
        "conditional refiner code=builder,docs=researcher write the thing",
        ConditionalCommand("refiner", (("code", "builder"), ("docs", "researcher")), "write the thing"),
    ),
    ("breaker reset builder", BreakerResetCommand("builder")),
    ("metrics", MetricsCommand()),
    ("metrics 30", MetricsCommand(30)),
    ("metrics 0007", MetricsCommand(7)),
    ("dispatch builder --deadline 000060 go", DispatchCommand("builder", "go", deadline=60)),
    ("cancel abcd", CancelCommand("abcd")),
    ("approve task_42", ApproveCommand("task_42")),
    ("reject Task-42", RejectCommand("Task-42")),
    ("retry 0123456789abcdef", RetryCommand("0123456789abcdef")),
    # routing suffix
    ("status -> telegram:-1001234567890", StatusCommand(route=TG)),
    ("list -> telegram:42", ListCommand(route=Route("telegram", "42"))),
    ("dispatch builder go -> slack:C0123ABCD", DispatchCommand("builder", "go", route=Route("slack", "C0123ABCD"))),
    # a direct-message channel is a Slack chat too (the configuration has always accepted D… home channels)
    ("status -> slack:D0123ABCD", StatusCommand(None, route=Route("slack", "D0123ABCD"))),
    ("broadcast go -> slack:G0123ABCD", BroadcastCommand("go", route=Route("slack", "G0123ABCD"))),
    (
        "fanout builder,refiner go -> discord:123456789012345678",
        FanOutCommand(("builder", "refiner"), "go", route=Route("discord", "123456789012345678")),
    ),
    ("cancel abcd -> web:ops-room", CancelCommand("abcd", route=Route("web", "ops-room"))),
    ("config -> TELEGRAM:7", ConfigCommand(route=Route("telegram", "7"))),
    ("dispatch builder go\n->   telegram:-5  ", DispatchCommand("builder", "go", route=Route("telegram", "-5"))),
    # `->` that is not a final route stays task text
    ("dispatch builder map a -> b", DispatchCommand("builder", "map a -> b")),
    ("dispatch builder map a -> b:c", DispatchCommand("builder", "map a -> b:c")),
    ("dispatch builder send -> telegram:1 later", DispatchCommand("builder", "send -> telegram:1 later")),
    ("dispatch builder x ->telegram:1", DispatchCommand("builder", "x ->telegram:1")),
    (
        "dispatch builder a -> telegram:1 -> slack:C0123ABCD",
        DispatchCommand("builder", "a -> telegram:1", route=Route("slack", "C0123ABCD")),
    ),
    ("broadcast -> -> telegram:1", BroadcastCommand("->", route=Route("telegram", "1"))),
    ("broadcast ratio 16:9 -> tv", BroadcastCommand("ratio 16:9 -> tv")),
]


@pytest.mark.parametrize(("text", "expected"), WELL_FORMED)
def test_well_formed(text: str, expected: SwarmCommand) -> None:
    assert p(text) == expected


def test_every_subcommand_has_a_well_formed_row() -> None:
    assert {c.verb for _, c in WELL_FORMED} == set(VERBS)


@pytest.mark.parametrize(
    ("command", "pattern"),
    [
        (DispatchCommand("builder", "x"), Pattern.DISPATCH),
        (BroadcastCommand("x"), Pattern.BROADCAST),
        (PipelineCommand(("builder",), "x"), Pattern.PIPELINE),
        (FanOutCommand(("builder",), "x"), Pattern.FAN_OUT),
        (ConsultCommand(("builder",), "x"), Pattern.CONSULT),
    ],
)
def test_starting_commands_name_their_engine_pattern(command: Any, pattern: Pattern) -> None:
    assert command.pattern is pattern


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("status", {"verb": "status", "task_id": None, "route": None}),
        (
            "fanout builder,refiner go\nnow -> slack:C0123ABCD",
            {
                "verb": "fanout",
                "workers": ["builder", "refiner"],
                "prompt": "go\nnow",
                "strategy": "collect",
                "expect": None,
                "deadline": None,
                "route": {"platform": "slack", "chat": "C0123ABCD"},
            },
        ),
        (
            "pipeline quick x",
            {
                "verb": "pipeline",
                "workers": ["researcher", "builder"],
                "prompt": "x",
                "preset": "quick",
                "expect": None,
                "deadline": None,
                "route": None,
            },
        ),
    ],
)
def test_to_json(text: str, expected: dict[str, object]) -> None:
    data = p(text).to_json()
    assert data == expected
    assert json.loads(json.dumps(data)) == expected


# ---------------------------------------------------------------- malformed

MALFORMED: list[tuple[str, str]] = [
    # missing arguments
    ("dispatch", "dispatch needs a worker and a task: /swarm dispatch <worker|auto> <task>"),
    ("dispatch builder", "dispatch needs a worker and a task: /swarm dispatch <worker|auto> <task>"),
    ("dispatch auto   ", "dispatch needs a worker and a task"),
    ("broadcast", "broadcast needs a task: /swarm broadcast <task>"),
    ("pipeline", "pipeline needs a preset or workers, and a task: /swarm pipeline <preset|w1,w2,…> <task>"),
    ("pipeline standard", "pipeline needs a preset or workers, and a task"),
    (
        "fanout",
        "fanout needs workers and a task: /swarm fanout <w1,w2,…> [--strategy collect|first_valid|"
        "merge_all|vote|best|synthesize] <task>",
    ),
    ("fanout builder,refiner", "fanout needs workers and a task"),
    ("consult", "consult needs workers and a question: /swarm consult <w1,w2,…> <question>"),
    ("consult builder", "consult needs workers and a question"),
    ("cancel", "cancel needs a task id: /swarm cancel <task-id>"),
    ("approve", "approve needs a task id: /swarm approve <task-id>"),
    ("reject", "reject needs a task id: /swarm reject <task-id>"),
    ("retry", "retry needs a task id: /swarm retry <task-id>"),
    # extra arguments
    ("help me", "help takes no arguments: /swarm help"),
    ("list all", "list takes no arguments: /swarm list"),
    ("history 10", "history takes no arguments: /swarm history"),
    ("workers x", "workers takes no arguments: /swarm workers"),
    ("config show", "config takes no arguments: /swarm config"),
    ("status abcd efgh", "status takes at most one task id: /swarm status [task-id]"),
    ("cancel abcd efgh", "cancel takes one task id: /swarm cancel <task-id>"),
    ("retry abcd now", "retry takes one task id"),
    # bad task ids
    ("status abc", "'abc' is not a task id (4 to 32 letters, digits, '-' or '_'): /swarm status [task-id]"),
    ("cancel " + "a" * 33, "is not a task id"),
    ("approve ab/cd", "'ab/cd' is not a task id"),
    ("reject ab.cd", "'ab.cd' is not a task id"),
    ("retry tâche1", "'tâche1' is not a task id"),
    # unknown workers
    ("dispatch buidler go", "unknown worker 'buidler'; did you mean 'builder'? (workers: builder, refiner, researcher"),
    ("dispatch zzz go", "unknown worker 'zzz' (workers: builder, refiner, researcher, validator)"),
    ("fanout builder,validtor go", "unknown worker 'validtor'; did you mean 'validator'?"),
    ("consult builder,nobody go", "unknown worker 'nobody'"),
    ("pipeline researcher,bilder go", "unknown worker 'bilder'; did you mean 'builder'?"),
    ("pipeline stnadard go", "unknown pipeline preset or worker 'stnadard'; did you mean 'standard'?"),
    ("pipeline nothing go", "unknown pipeline preset or worker 'nothing' (presets: quick, standard; workers:"),
    # auto where not allowed
    ("fanout auto go", "'auto' picks a single worker and only works with dispatch; name the fanout workers"),
    ("fanout builder,auto go", "'auto' picks a single worker and only works with dispatch"),
    ("consult auto,builder go", "name the consult workers"),
    ("pipeline auto go", "name the pipeline workers"),
    ("pipeline builder,auto go", "only works with dispatch"),
    # bad worker lists
    ("fanout builder, refiner go", "the worker list 'builder,' has an empty name; separate worker names with commas"),
    ("fanout ,builder go", "has an empty name"),
    ("consult builder,,refiner go", "has an empty name"),
    ("pipeline builder,refiner, go", "has an empty name"),
    (
        "fanout builder,builder go",
        "worker 'builder' is listed twice: /swarm fanout <w1,w2,…> [--strategy collect|first_valid|"
        "merge_all|vote|best|synthesize] <task>",
    ),
    ("consult refiner,builder,refiner go", "worker 'refiner' is listed twice"),
    ("pipeline builder,Builder go", "worker 'builder' is listed twice"),
    # options a steering command would drop (they were read and ignored: the person saw nothing happen)
    ("cancel --deadline 5 abcd", "cancel takes a task id only: --deadline would change nothing"),
    ("retry --expect json abcd", "retry takes a task id only: --expect would change nothing"),
    # routes
    ("-> telegram:1", "a route needs a command before it: /swarm <subcommand> … -> <platform>:<chat>"),
    ("  -> slack:C0123ABCD  ", "a route needs a command before it"),
    # a bare trailing arrow is a route begun and never finished: it was taken as task text, and the result came back
    # to this chat instead of the one meant
    ("dispatch builder ends with ->", "a route needs <platform>:<chat> after '->' (telegram"),
    ("broadcast go ->  \n", "a route needs <platform>:<chat> after '->'"),
    ("status ->", "/swarm <subcommand> … -> <platform>:<chat>"),
    ("->", "a route needs <platform>:<chat> after '->'"),
    ("broadcast -> -> ->", "a route needs <platform>:<chat> after '->'"),
    ("dispatch builder -> telegram:1", "dispatch needs a worker and a task"),
    ("broadcast -> discord:1", "broadcast needs a task"),
    ("status -> telegram:abc", "cannot route to 'telegram:abc': a Telegram chat id is a non-zero integer"),
    ("status -> telegram:0", "a Telegram chat id is a non-zero integer"),
    ("status -> telegram:-0", "a Telegram chat id is a non-zero integer"),
    ("status -> telegram:007", "a Telegram chat id is a non-zero integer"),
    ("status -> telegram:99999999999999999999", "a Telegram chat id is a non-zero integer"),
    ("status -> telegram:", "a Telegram chat id is a non-zero integer"),
    ("status -> telegram:C0123ABCD", "a Telegram chat id"),
    ("status -> slack:c0123abcd", "a Slack channel id is C, G or D followed by capital letters and digits"),
    ("status -> slack:U0123ABCD", "a Slack channel id"),
    ("status -> slack:123", "a Slack channel id"),
    ("status -> discord:-123456789012345678", "a Discord channel id is a positive number"),
    ("status -> discord:C0123ABCD", "a Discord channel id is a positive number"),
    ("status -> discord:99999999999999999999", "a Discord channel id is a positive number"),
    ("status -> discord:0", "a Discord channel id"),
    ("status -> web:a/b", "a web console chat is 1 to 64 letters"),
    ("status -> web:" + "a" * 65, "a web console chat"),
    ("dispatch builder go -> telgram:1", "unknown platform 'telgram' in the route; did you mean 'telegram'?"),
    ("dispatch builder go -> discrod:1", "did you mean 'discord'?"),
    ("dispatch builder go -> slak:C0123ABCD", "did you mean 'slack'?"),
    # a route that is not recognised stays as arguments, and arguments are checked
    ("list -> tv:1", "list takes no arguments"),
    # numbers: ASCII digits only ("²" passed str.isdigit() and then crashed int(), "٣" was read as 3), and a
    # string of digits too long for int() is refused, not a crash
    ("dispatch builder --deadline ² go", "--deadline takes whole seconds from 1 to 86400"),
    ("dispatch builder --deadline ٣ go", "--deadline takes whole seconds from 1 to 86400"),
    ("dispatch builder --deadline " + "9" * 5000 + " go", "--deadline takes whole seconds from 1 to 86400"),
    ("dispatch builder --deadline 0 go", "--deadline takes whole seconds from 1 to 86400"),
    ("dispatch builder --deadline -5 go", "--deadline takes whole seconds from 1 to 86400"),
    ("dispatch builder --deadline 86401 go", "--deadline takes whole seconds from 1 to 86400"),
    ("dispatch builder --deadline 1e3 go", "--deadline takes whole seconds from 1 to 86400"),
    ("metrics ³", "metrics takes a number of days from 1 to 366"),
    ("metrics ٣", "metrics takes a number of days from 1 to 366"),
    ("metrics " + "7" * 5000, "metrics takes a number of days from 1 to 366"),
]


@pytest.mark.parametrize(("text", "expected"), MALFORMED)
def test_malformed(text: str, expected: str) -> None:
    exc = error(text)
    assert expected in exc.message
    assert str(exc) == exc.message
    assert exc.usage
    assert exc.usage in exc.message


@pytest.mark.parametrize(
    "verb",
    [v for v in VERBS if v not in ("help", "status", "list", "history", "workers", "config", "metrics", "tasks")],
)
def test_each_subcommand_with_arguments_says_what_it_needs(verb: str) -> None:
    exc = error(verb)
    assert exc.message.startswith(f"{verb} needs ")
    assert exc.message.endswith(USAGES[verb].line)


# ---------------------------------------------------------------- limits


@pytest.mark.parametrize(
    ("prompt", "ok"),
    [
        ("x" * MAX_PROMPT_BYTES, True),
        ("x" * (MAX_PROMPT_BYTES + 1), False),
        ("é" * (MAX_PROMPT_BYTES // 2), True),
        # fewer characters than the limit, more bytes: the limit is on UTF-8 bytes
        ("é" * (MAX_PROMPT_BYTES // 2 + 1), False),
        ("🙂" * (MAX_PROMPT_BYTES // 4 + 1), False),
    ],
)
@pytest.mark.parametrize("template", ["dispatch builder {}", "broadcast {}", "pipeline quick {}", "consult builder {}"])
def test_prompt_limit_in_utf8_bytes(prompt: str, ok: bool, template: str) -> None:
    text = template.format(prompt)
    if ok:
        data = p(text).to_json()
        assert data.get("prompt", data.get("question")) == prompt
    else:
        exc = error(text)
        size = len(prompt.encode())
        assert f"is {size:,} bytes; the limit is 65,536 bytes (64 KiB)" in exc.message


def test_prompt_limit_ignores_the_route() -> None:
    command = p("broadcast " + "x" * MAX_PROMPT_BYTES + " -> telegram:1")
    assert isinstance(command, BroadcastCommand)
    assert command.route == Route("telegram", "1")


@pytest.mark.parametrize(
    ("count", "ok"),
    [(1, True), (MAX_LIST_WORKERS, True), (MAX_LIST_WORKERS + 1, False), (40, False)],
)
@pytest.mark.parametrize("verb", ["fanout", "consult", "pipeline"])
def test_worker_list_limit(count: int, ok: bool, verb: str) -> None:
    text = f"{verb} {','.join(MANY[:count])} go"
    if ok:
        assert p(text, MANY).to_json()["workers"] == list(MANY[:count])
    else:
        exc = error(text, MANY)
        assert f"{count} workers listed; at most 32 may take part in one task" in exc.message


def test_worker_list_limit_is_checked_before_names() -> None:
    exc = error("fanout " + ",".join(["nobody"] * 1000) + " go")
    assert "1000 workers listed" in exc.message


# ---------------------------------------------------------------- unknown subcommands


@pytest.mark.parametrize(
    ("text", "suggestion"),
    [
        ("dispach builder go", "dispatch"),
        ("dispath builder go", "dispatch"),
        ("stauts", "status"),
        ("statsu abcd", "status"),
        ("hlep", "help"),
        ("lsit", "list"),
        ("histroy", "history"),
        ("worker", "workers"),
        ("broadcats go", "broadcast"),
        ("pipline quick go", "pipeline"),
        ("fan-out a,b go", "fanout"),
        ("fanuot a,b go", "fanout"),
        ("consul a q", "consult"),
        ("cancle abcd", "cancel"),
        ("aprove abcd", "approve"),
        ("rejct abcd", "reject"),
        ("rety abcd", "retry"),
        ("confg", "config"),
        ("DISPACH x y", "dispatch"),
    ],
)
def test_unknown_subcommand_suggests_the_nearest(text: str, suggestion: str) -> None:
    exc = error(text)
    word = text.split()[0]
    assert exc.message.startswith(f"unknown subcommand {word!r}; did you mean {suggestion!r}?")
    assert help_text() in exc.message
    assert exc.usage == help_text()


@pytest.mark.parametrize("text", ["xyzzy", "/swarm", "42", "-> x"])
def test_unknown_subcommand_without_a_near_match(text: str) -> None:
    exc = error(text)
    assert exc.message.startswith("unknown subcommand ")
    assert "did you mean" not in exc.message.splitlines()[0]
    assert help_text() in exc.message


def test_unknown_subcommand_message_is_bounded() -> None:
    exc = error("z" * 10_000)
    assert len(exc.message.splitlines()[0]) < 100


# ---------------------------------------------------------------- help text


@pytest.mark.parametrize("verb", VERBS)
def test_help_text_lists_every_subcommand_with_its_access(verb: str) -> None:
    lines = [line for line in help_text().splitlines() if line.split()[:2] == ["/swarm", verb]]
    assert len(lines) == 1
    line = lines[0]
    assert USAGES[verb].line in line
    access = USAGES[verb].access
    if access is Access.READ:
        assert "(reading, anyone)" in line
    elif access is Access.STEER:
        assert "(steering, admin)" in line
    else:
        assert "(admin)" in line


def test_help_text_covers_exactly_the_grammar_and_the_route() -> None:
    assert set(VERBS) == {
        "help",
        "status",
        "list",
        "history",
        "workers",
        "dispatch",
        "broadcast",
        "pipeline",
        "fanout",
        "consult",
        "cancel",
        "approve",
        "reject",
        "retry",
        "config",
        "conditional",
        "breaker",
        "metrics",
        "tasks",
    }
    assert len(help_text().splitlines()) == len(VERBS) + 2
    assert "--expect json|<schema>" in help_text()
    assert "-> <platform>:<chat>" in help_text()


@pytest.mark.parametrize(
    ("verb", "access"),
    [
        ("help", Access.READ),
        ("status", Access.READ),
        ("list", Access.READ),
        ("history", Access.READ),
        ("workers", Access.READ),
        ("dispatch", Access.STEER),
        ("broadcast", Access.STEER),
        ("pipeline", Access.STEER),
        ("fanout", Access.STEER),
        ("consult", Access.STEER),
        ("cancel", Access.STEER),
        ("approve", Access.STEER),
        ("reject", Access.STEER),
        ("retry", Access.STEER),
        ("config", Access.ADMIN),
        ("conditional", Access.STEER),
        ("breaker", Access.ADMIN),
        ("metrics", Access.READ),
        ("tasks", Access.READ),
    ],
)
def test_parsed_access_matches_the_help(verb: str, access: Access) -> None:
    command = next(c for _, c in WELL_FORMED if c.verb == verb)
    assert command.access is access
    assert USAGES[verb].access is access


# ---------------------------------------------------------------- roles

PLATFORM_OPERATORS: dict[str, tuple[dict[str, Any], str, str]] = {
    # platform: (config fragment with exactly one operator, the operator, a stranger)
    "telegram": ({"platforms": {"telegram": {"admins": [111]}}}, "telegram:111", "telegram:999"),
    "slack": ({"platforms": {"slack": {"admins": ["U111"]}}}, "slack:U111", "slack:U999"),
    "discord": ({"platforms": {"discord": {"admins": [222]}}}, "discord:222", "discord:999"),
    "cli": ({"approvals": {"approvers": ["cli:alice"]}}, "cli:alice", "cli:mallory"),
}
PLATFORMS = tuple(PLATFORM_OPERATORS)

READING = ["help", "status", "status abcd", "list", "history", "workers", "tasks", "tasks --worker builder"]
STEERING = [
    "dispatch builder go",
    "dispatch auto go",
    "broadcast go",
    "pipeline quick go",
    "fanout builder,refiner go",
    "consult builder,refiner why?",
    "cancel abcd",
    "approve abcd",
    "reject abcd",
    "retry abcd",
]


def config(*fragments: dict[str, Any], shared: bool = False) -> KazmaConfig:
    merged: dict[str, Any] = {"swarm": {"allow_shared_operators": shared}}
    for fragment in fragments:
        for key, value in fragment.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
    return KazmaConfig.model_validate(merged)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("text", READING)
def test_reading_is_open_to_everyone(platform: str, text: str) -> None:
    fragment, _, stranger = PLATFORM_OPERATORS[platform]
    command = p(text)
    assert required_role(command) is Role.READER
    assert authorize(command, actor=stranger, platform=platform, is_admin=False, config=config(fragment)) is None


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("text", [*STEERING, "config"])
def test_steering_and_config_refuse_readers(platform: str, text: str) -> None:
    fragment, _, stranger = PLATFORM_OPERATORS[platform]
    command = p(text)
    assert required_role(command) is Role.OPERATOR
    refusal = authorize(command, actor=stranger, platform=platform, is_admin=False, config=config(fragment))
    assert refusal is not None
    assert refusal.reason is RefusalReason.NOT_OPERATOR
    assert f"/swarm {command.verb} " in refusal.message
    assert f"{stranger} is not one" in refusal.message
    where = "approvals.approvers" if platform == "cli" else f"platforms.{platform}.admins"
    assert where in refusal.message


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("text", [*READING, *STEERING, "config"])
def test_the_configured_operator_may_run_everything(platform: str, text: str) -> None:
    fragment, operator, _ = PLATFORM_OPERATORS[platform]
    command = p(text)
    assert authorize(command, actor=operator, platform=platform, is_admin=False, config=config(fragment)) is None


@pytest.mark.parametrize("platform", ["telegram", "slack", "discord"])
@pytest.mark.parametrize("text", ["dispatch builder go", "config", "list -> telegram:1"])
def test_the_adapter_admin_flag_is_enough(platform: str, text: str) -> None:
    refusal = authorize(p(text), actor=f"{platform}:555", platform=platform, is_admin=True, config=config())
    assert refusal is None


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize(
    "text",
    ["status -> telegram:-100", "list -> slack:C0123ABCD", "help -> discord:123", "workers -> web:room"],
)
def test_a_route_needs_an_operator(platform: str, text: str) -> None:
    fragment, operator, stranger = PLATFORM_OPERATORS[platform]
    command = p(text)
    assert required_role(command) is Role.OPERATOR
    refusal = authorize(command, actor=stranger, platform=platform, is_admin=False, config=config(fragment))
    assert refusal is not None
    assert refusal.reason is RefusalReason.NOT_OPERATOR
    assert f"sending the result of /swarm {command.verb} to {command.route}" in refusal.message
    assert authorize(command, actor=operator, platform=platform, is_admin=False, config=config(fragment)) is None


@pytest.mark.parametrize(
    ("actor", "platform", "fragment"),
    [
        # an operator on one platform is nobody on another
        ("telegram:111", "slack", PLATFORM_OPERATORS["telegram"][0]),
        ("telegram:111", "cli", {"approvals": {"approvers": ["telegram:111"]}}),
        ("slack:U111", "discord", PLATFORM_OPERATORS["slack"][0]),
        ("cli:alice", "telegram", PLATFORM_OPERATORS["cli"][0]),
        # approvers decide approval cards; on chat platforms, steering the swarm is for admins
        ("telegram:111", "telegram", {"approvals": {"approvers": ["telegram:111"]}}),
    ],
)
def test_operator_status_does_not_cross_platforms(actor: str, platform: str, fragment: dict[str, Any]) -> None:
    refusal = authorize(p("cancel abcd"), actor=actor, platform=platform, is_admin=False, config=config(fragment))
    assert refusal is not None
    assert refusal.reason is RefusalReason.NOT_OPERATOR


TWO_OPERATORS: dict[str, dict[str, Any]] = {
    "telegram": {"platforms": {"telegram": {"admins": [111, 112]}}},
    "slack": {"platforms": {"slack": {"admins": ["U111", "U112"]}}},
    "discord": {"platforms": {"discord": {"admins": [222, 223]}}},
    "cli": {"approvals": {"approvers": ["cli:alice", "cli:bob"]}},
}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("text", STEERING)
def test_shared_operators_refused_unless_opted_in(platform: str, text: str) -> None:
    _, operator, _ = PLATFORM_OPERATORS[platform]
    command = p(text)
    refusal = authorize(
        command, actor=operator, platform=platform, is_admin=False, config=config(TWO_OPERATORS[platform])
    )
    assert refusal is not None
    assert refusal.reason is RefusalReason.SHARED_OPERATORS
    assert SHARED_OPERATORS_HINT in refusal.message
    assert "tasks are not separated per user; set swarm.allow_shared_operators: true to allow it" in refusal.message
    assert "2 human operators" in refusal.message
    opted_in = config(TWO_OPERATORS[platform], shared=True)
    assert authorize(command, actor=operator, platform=platform, is_admin=False, config=opted_in) is None


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("text", [*READING, "config", "status abcd -> telegram:1"])
def test_shared_operators_may_still_read_and_see_config(platform: str, text: str) -> None:
    _, operator, _ = PLATFORM_OPERATORS[platform]
    cfg = config(TWO_OPERATORS[platform])
    assert authorize(p(text), actor=operator, platform=platform, is_admin=False, config=cfg) is None


def test_shared_operators_check_comes_after_the_operator_check() -> None:
    refusal = authorize(
        p("cancel abcd"),
        actor="telegram:999",
        platform="telegram",
        is_admin=False,
        config=config(TWO_OPERATORS["telegram"]),
    )
    assert refusal is not None
    assert refusal.reason is RefusalReason.NOT_OPERATOR


@pytest.mark.parametrize(
    ("fragments", "count"),
    [
        ((), 0),
        (({"platforms": {"telegram": {"admins": [111]}}},), 1),
        # the same identity as admin and approver is one person
        (({"platforms": {"telegram": {"admins": [111]}}}, {"approvals": {"approvers": ["telegram:111"]}}), 1),
        # one person on two platforms has two identities and counts twice
        (
            (
                {"platforms": {"telegram": {"admins": [111]}, "slack": {"admins": ["U111"]}}},
                {"approvals": {"approvers": ["telegram:111"]}},
            ),
            2,
        ),
        (({"approvals": {"approvers": ["web:admin", "cli:alice"]}},), 2),
        (
            (
                {
                    "platforms": {
                        "telegram": {"admins": [111]},
                        "slack": {"admins": ["U111"]},
                        "discord": {"admins": [222]},
                    }
                },
                {"approvals": {"approvers": ["telegram:111", "slack:U111", "discord:222", "web:admin"]}},
            ),
            4,
        ),
    ],
)
def test_human_operator_count(fragments: tuple[dict[str, Any], ...], count: int) -> None:
    cfg = config(*fragments)
    assert len(human_operators(cfg)) == count
    refusal = authorize(p("broadcast go"), actor="x:y", platform="telegram", is_admin=True, config=cfg)
    assert (refusal is not None) is (count > 1)


def test_one_person_on_two_platforms_is_refused_as_shared() -> None:
    cfg = config({"platforms": {"telegram": {"admins": [111]}, "slack": {"admins": ["U111"]}}})
    refusal = authorize(p("retry abcd"), actor="slack:U111", platform="slack", is_admin=False, config=cfg)
    assert refusal is not None
    assert refusal.reason is RefusalReason.SHARED_OPERATORS


# ---------------------------------------------------------------- CLI


@pytest.fixture
def cli_obj(tmp_path: Path) -> Context:
    path = tmp_path / "kazma.yaml"
    path.write_text("pipelines:\n  quick: [researcher, builder]\n", encoding="utf-8")
    return Context(path)


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["help"], "help"),
        (["status"], "status"),
        (["status", "abcd"], "status abcd"),
        (["list"], "list"),
        (["history"], "history"),
        (["workers"], "workers"),
        (["config"], "config"),
        (["dispatch", "builder", "write", "a script"], "dispatch builder write a script"),
        (["dispatch", "auto", "multi\nline -> b"], "dispatch auto multi\nline -> b"),
        (["broadcast", "go"], "broadcast go"),
        (["pipeline", "quick", "go"], "pipeline quick go"),
        (["pipeline", "researcher,builder", "go"], "pipeline researcher,builder go"),
        (["fanout", "builder,refiner", "go"], "fanout builder,refiner go"),
        (["consult", "builder,refiner", "why?"], "consult builder,refiner why?"),
        (["cancel", "abcd"], "cancel abcd"),
        (["approve", "abcd"], "approve abcd"),
        (["reject", "abcd"], "reject abcd"),
        (["retry", "abcd"], "retry abcd"),
        (["dispatch", "--to", "slack:C0123ABCD", "builder", "go"], "dispatch builder go -> slack:C0123ABCD"),
        (["list", "--to", "telegram:-100"], "list -> telegram:-100"),
        (["cancel", "abcd", "--to", "discord:1"], "cancel abcd -> discord:1"),
    ],
)
def test_cli_prints_what_chat_would_parse(cli_obj: Context, args: list[str], text: str) -> None:
    result = CliRunner().invoke(swarm, ["--parse-only", *args], obj=cli_obj)
    assert result.exit_code == 0, result.output
    assert result.output.count("\n") == 1
    cfg = cli_obj.load().config
    assert json.loads(result.output) == parse(text, workers=cfg.agents.workers, pipelines=cfg.pipelines).to_json()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["dispatch", "buidler", "go"], "unknown worker 'buidler'; did you mean 'builder'?"),
        (["fanout", "builder,builder", "go"], "worker 'builder' is listed twice"),
        (["consult", "auto", "go"], "only works with dispatch"),
        (["cancel", "ab"], "'ab' is not a task id"),
        (["pipeline", "standard", "go"], "unknown pipeline preset or worker 'standard'"),
        (["broadcast", "x" * (MAX_PROMPT_BYTES + 1)], "the limit is 65,536 bytes"),
        (["status", "--to", "telegram:abc"], "a Telegram chat id is a non-zero integer"),
    ],
)
def test_cli_refuses_what_chat_refuses(cli_obj: Context, args: list[str], message: str) -> None:
    result = CliRunner().invoke(swarm, args, obj=cli_obj)
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["dispatch", "builder refiner", "go"],
        ["fanout", "builder, refiner", "go"],
        ["cancel", "ab cd"],
        ["list", "--to", "tv:1"],
        ["list", "--to", "slack: C1"],
        ["dispatch", "builder"],
    ],
)
def test_cli_argument_shapes_are_checked_before_parsing(cli_obj: Context, args: list[str]) -> None:
    result = CliRunner().invoke(swarm, args, obj=cli_obj)
    assert result.exit_code == 2
    assert result.output.startswith("Usage:")


@pytest.mark.parametrize("args", [["--help"], *[[verb, "--help"] for verb in VERBS]])
def test_cli_help_says_where_work_runs(args: list[str]) -> None:
    result = CliRunner().invoke(swarm, args)
    assert result.exit_code == 0
    assert "this process" in " ".join(result.output.split())


def test_cli_offers_every_subcommand() -> None:
    assert set(swarm.commands) == {*VERBS, *CLI_ONLY}


def _accepted_by_chat(strategy: str) -> bool:
    try:
        p(f"fanout researcher,builder --strategy {strategy} go")
    except GrammarError:
        return False
    return True


def _accepted_by_cli(strategy: str) -> bool:
    option = next(param for param in swarm.commands["fanout"].params if param.name == "strategy")
    try:
        option.type.convert(strategy, option, None)
    except click.BadParameter:
        return False
    return True


def _accepted_by_lead(strategy: str) -> bool:
    try:
        DispatchSwarmArgs.model_validate(
            {"pattern": "fan_out", "task": "go", "workers": ["researcher", "builder"], "aggregation": strategy}
        )
    except ValidationError:
        return False
    return True


def test_every_surface_accepts_the_same_strategies() -> None:
    # The lead's dispatch_swarm took first_valid while `/swarm fanout --strategy first_valid` was refused as an
    # unknown strategy (and the CLI's choice refused it too): the README says the options are the same everywhere.
    candidates = [*(a.value for a in Aggregation), "nonsense", "first-valid"]
    surfaces = {"chat": _accepted_by_chat, "cli": _accepted_by_cli, "lead": _accepted_by_lead}
    accepted = {name: {c for c in candidates if ok(c)} for name, ok in surfaces.items()}
    assert accepted == {name: {a.value for a in Aggregation} for name in surfaces}
