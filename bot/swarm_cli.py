"""``kazma swarm …``: the ``/swarm`` grammar from a terminal.

Every subcommand rebuilds the text a chat user would type and hands it to the
same :func:`~kazma.engine.swarm.grammar.parse`, so the CLI can never accept
something chat refuses, or the other way round.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable

import click

from kazma.bot.app import build_app
from kazma.bot.context import Context
from kazma.config import LoadedConfig
from kazma.config.registry import ROUTE_PLATFORMS
from kazma.engine.swarm.grammar import USAGES, GrammarError, parse

EXIT_USAGE = 2
_OPTIONS = "kazma.swarm.options"
_PENDING = "Runs in this process against the shared store; started work is waited for and its result printed."


def _context() -> Context:
    found = click.get_current_context().find_object(Context)
    # Standalone (not under `kazma`), fall back to the default config lookup.
    return found if found is not None else Context(None)


def _run(verb: str, *words: str, to: str | None = None) -> None:
    text = " ".join([verb, *words])
    if to is not None:
        text = f"{text} -> {to}"
    loaded = _context().load()
    try:
        command = parse(text, workers=loaded.config.agents.workers, pipelines=loaded.config.pipelines)
    except GrammarError as exc:
        click.echo(exc.message, err=True)
        sys.exit(EXIT_USAGE)
    found = click.get_current_context().meta.get(_OPTIONS)
    state = found if isinstance(found, _Options) else None
    if state is not None and state.parse_only:
        click.echo(json.dumps(command.to_json(), ensure_ascii=False))
        return
    login = state.login if state is not None else _default_login()
    sys.exit(asyncio.run(_execute(loaded, text, login)))


async def _execute(loaded: LoadedConfig, text: str, login: str) -> int:
    """Carry the command out like chat does, as ``cli:<login>``; wait for work it starts."""
    # No platform is started from the CLI: results are printed here, cards need `kazma run`.
    app = await build_app(loaded, adapters=[])
    try:
        answer = await app.conversations.swarm.run(  # type: ignore[union-attr]
            text, actor=f"cli:{login}", platform="cli", chat="terminal", is_admin=False
        )
        click.echo(answer)
        if answer.startswith("swarm task ") and " started " in answer:
            task_id = answer.split()[2]
            while (record := await app.swarm.wait(task_id, 90)) is not None and not record.status.terminal:
                click.echo(f"… {record.status.value}: {record.current_step}", err=True)
            if record is not None:
                output = record.result.get("output", "") if record.result else ""
                click.echo(f"{record.status.value}: {output or record.error or ''}")
                return 0 if record.status.value in ("succeeded", "partial") else 1
        return 1 if answer.startswith("Not started:") else 0
    finally:
        await app.stop()


def _default_login() -> str:
    return os.environ.get("USER") or os.environ.get("LOGNAME") or "operator"


class _Options:
    def __init__(self, login: str, parse_only: bool) -> None:
        self.login = login
        self.parse_only = parse_only


def _word(value: str) -> str:
    """Chat splits on whitespace, so one CLI argument must stay one word there too."""
    if not value or value != "".join(value.split()):
        raise click.BadParameter(f"{value!r} must be one word without spaces")
    return value


def _word_callback(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    return None if value is None else _word(value)


def _route_callback(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    value = _word_callback(ctx, param, value)
    # Without this, a --to that is not a route would silently become task text.
    if value is not None and value.partition(":")[0].lower() not in ROUTE_PLATFORMS:
        raise click.BadParameter(f"expected PLATFORM:CHAT with platform one of {', '.join(ROUTE_PLATFORMS)}")
    return value


_to_option = click.option(
    "--to",
    metavar="PLATFORM:CHAT",
    default=None,
    callback=_route_callback,
    help="Post the result in another chat (telegram, slack, discord or web); admin only.",
)


def _help(verb: str) -> str:
    usage = USAGES[verb]
    return f"{usage.summary[0].upper()}{usage.summary[1:]} ({usage.line}). {_PENDING}"


@click.group()
@click.option("--as", "login", default=None, help="Your login, recorded as cli:<login> (default: $USER).")
@click.option("--parse-only", is_flag=True, help="Print the parsed command as one JSON line and stop.")
@click.pass_context
def swarm(ctx: click.Context, login: str | None, parse_only: bool) -> None:
    """Drive the swarm with the same grammar as /swarm in chat.

    Steering commands need cli:<login> in approvals.approvers. Work started here
    runs in this process; its result is printed when it ends.
    """
    ctx.meta[_OPTIONS] = _Options(login or _default_login(), parse_only)


def _no_argument_command(verb: str) -> Callable[[str | None], None]:
    def command(to: str | None) -> None:
        _run(verb, to=to)

    return command


for _verb in ("help", "list", "history", "workers", "config", "metrics"):
    swarm.command(_verb, help=_help(_verb))(_to_option(_no_argument_command(_verb)))


def _start_options(function: Callable[..., None]) -> Callable[..., None]:
    function = click.option(
        "--expect", default=None, callback=_word_callback, help="json, or a schema from swarm.schemas."
    )(function)
    return click.option(
        "--deadline", type=click.IntRange(1, 86400), default=None, help="Seconds the whole task may take."
    )(function)


def _option_words(expect: str | None, deadline: int | None, strategy: str | None = None) -> list[str]:
    words = []
    for name, value in (("--strategy", strategy), ("--expect", expect), ("--deadline", deadline)):
        if value is not None:
            words += [name, str(value)]
    return words


@swarm.command("status", help=_help("status"))
@click.argument("task_id", required=False, callback=_word_callback)
@_to_option
def status(task_id: str | None, to: str | None) -> None:
    _run("status", *([task_id] if task_id else []), to=to)


@swarm.command("dispatch", help=_help("dispatch"))
@click.argument("worker", callback=_word_callback)
@click.argument("task", nargs=-1, required=True)
@_to_option
@_start_options
def dispatch(worker: str, task: tuple[str, ...], to: str | None, expect: str | None, deadline: int | None) -> None:
    _run("dispatch", worker, *_option_words(expect, deadline), *task, to=to)


@swarm.command("broadcast", help=_help("broadcast"))
@click.argument("task", nargs=-1, required=True)
@_to_option
@_start_options
def broadcast(task: tuple[str, ...], to: str | None, expect: str | None, deadline: int | None) -> None:
    _run("broadcast", *_option_words(expect, deadline), *task, to=to)


@swarm.command("pipeline", help=_help("pipeline"))
@click.argument("stages", metavar="PRESET|W1,W2,…", callback=_word_callback)
@click.argument("task", nargs=-1, required=True)
@_to_option
@_start_options
def pipeline(stages: str, task: tuple[str, ...], to: str | None, expect: str | None, deadline: int | None) -> None:
    _run("pipeline", stages, *_option_words(expect, deadline), *task, to=to)


@swarm.command("fanout", help=_help("fanout"))
@click.argument("workers", metavar="W1,W2,…", callback=_word_callback)
@click.argument("task", nargs=-1, required=True)
@_to_option
@_start_options
@click.option(
    "--strategy",
    type=click.Choice(["collect", "merge_all", "vote", "best", "synthesize"]),
    default=None,
    help="How the answers are aggregated (default collect).",
)
def fanout(
    workers: str,
    task: tuple[str, ...],
    to: str | None,
    expect: str | None,
    deadline: int | None,
    strategy: str | None,
) -> None:
    _run("fanout", workers, *_option_words(expect, deadline, strategy), *task, to=to)


@swarm.command("consult", help=_help("consult"))
@click.argument("workers", metavar="W1,W2,…", callback=_word_callback)
@click.argument("question", nargs=-1, required=True)
@_to_option
@_start_options
def consult(workers: str, question: tuple[str, ...], to: str | None, expect: str | None, deadline: int | None) -> None:
    _run("consult", workers, *_option_words(expect, deadline), *question, to=to)


@swarm.command("conditional", help=_help("conditional"))
@click.argument("router", callback=_word_callback)
@click.argument("routes", metavar="BRANCH=WORKER,…", callback=_word_callback)
@click.argument("task", nargs=-1, required=True)
@_to_option
@_start_options
def conditional(
    router: str, routes: str, task: tuple[str, ...], to: str | None, expect: str | None, deadline: int | None
) -> None:
    _run("conditional", router, routes, *_option_words(expect, deadline), *task, to=to)


@swarm.command("breaker", help=_help("breaker"))
@click.argument("action", type=click.Choice(["reset"]))
@click.argument("worker", callback=_word_callback)
@_to_option
def breaker(action: str, worker: str, to: str | None) -> None:
    _run("breaker", action, worker, to=to)


def _task_command(verb: str) -> Callable[[str, str | None], None]:
    def command(task_id: str, to: str | None) -> None:
        _run(verb, task_id, to=to)

    return command


for _verb in ("cancel", "approve", "reject", "retry"):
    swarm.command(_verb, help=_help(_verb))(
        click.argument("task_id", callback=_word_callback)(_to_option(_task_command(_verb)))
    )
