"""``kazma swarm …``: the ``/swarm`` grammar from a terminal.

Every subcommand rebuilds the text a chat user would type and hands it to the
same :func:`~kazma.engine.swarm.grammar.parse`, so the CLI can never accept
something chat refuses, or the other way round.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import click

from kazma.bot.app import build_app
from kazma.bot.cli.cli_identity import cli_login
from kazma.bot.cli.context import Context
from kazma.bot.store import require_store
from kazma.config import LoadedConfig
from kazma.config.address import Actor, Address, AddressError
from kazma.config.registry import ROUTE_PLATFORMS
from kazma.engine.swarm.commands import ASK_AGAIN, started_task
from kazma.engine.swarm.endings import ending_lines
from kazma.engine.swarm.grammar import USAGES, parse
from kazma.engine.swarm.limits import LimitExceeded, check_context
from kazma.engine.swarm.owners import this_terminal
from kazma.engine.swarm.records import task_json
from kazma.engine.swarm.registry import for_verb, registered
from kazma.engine.swarm.roles import authorize
from kazma.engine.swarm.syntax import STRATEGIES, Access, GrammarError

EXIT_USAGE = 2
CLI_ONLY = ("show",)  # subcommands of the terminal alone (JSON for scripts), beside the /swarm grammar
_OPTIONS = "kazma.swarm.options"
_PENDING = "Runs in this process against the shared store; started work is waited for and its result printed."


def _context() -> Context:
    found = click.get_current_context().find_object(Context)
    # Standalone (not under `kazma`), fall back to the default config lookup.
    return found if found is not None else Context(None)


# A route's arrow, as the terminal hands it to click: "->" starts with "-", so click took it for an unknown option
# ("No such option '->'") and the README's `… -> slack:C0123` failed from a terminal. A NUL no shell can pass in an
# argument stands in for it while click parses, and the grammar gets the arrow back. So for a word the arrow
# begins after dashes only (`->slack:C1`, `-->x`): chat's grammar reads it as task text, and click as an option.
ARROW = "->"
_HELD = "\x00"
_ARROW_HELD = _HELD + ARROW
_ARROW_WORD = re.compile(r"-+>")


def _held(arg: str) -> str:
    """``arg`` as click may parse it: a word that begins with an arrow, behind a NUL."""
    return _HELD + arg if _ARROW_WORD.match(arg) else arg


def _run(verb: str, *words: str, to: str | None = None, context: str = "", confirm: bool | None = None) -> None:
    text = " ".join([verb, *words]).replace(_HELD, "")
    if to is not None:
        if _ends_in_route(text.split()):
            # `… -> slack:C1 --to discord:2`: the --to would have made the typed route task text, unsaid
            click.echo(f"more than one route (-> {text.split()[-1]} and --to {to}): give one", err=True)
            sys.exit(EXIT_USAGE)
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
    login = cli_login(loaded.config, state.login if state is not None else None)
    # The same question swarm.run asks first: its answer is a sentence, and a script needs the exit code to
    # tell "refused" from "done" (a refused cancel or retry ended 0).
    refused = authorize(command, actor=str(Actor("cli", login)), platform="cli", is_admin=False, config=loaded.config)
    starts = for_verb(verb) is not None
    reads = command.access is Access.READ
    sys.exit(
        asyncio.run(
            _execute(loaded, text, login, context, confirm, refused=refused is not None, starts=starts, reads=reads)
        )
    )


# Answers that say nothing was done: the command ends 1 (an unknown task id, a store that did not answer).
_NOT_DONE = ("Not started:", "no swarm task '", 'no swarm task "', "The swarm's task store is unavailable")


async def _execute(
    loaded: LoadedConfig,
    text: str,
    login: str,
    context: str = "",
    confirm: bool | None = None,
    *,
    refused: bool = False,
    starts: bool = False,
    reads: bool = False,
) -> int:
    """Carry the command out like chat does, as ``cli:<login>``; wait for work it starts.

    ``confirm`` (retry): a retry that must be asked twice (its outcome unknown, or its tools ran) is asked again
    here, in this process, when True (``--yes``) or when the person answers yes at the terminal; chat's second
    send within five minutes, which a new process for each command could never make."""
    # Only work a command ``starts`` may make the store, as `kazma run` would. Reading or steering tasks answered
    # from an empty store made on the spot at a mistyped store.path ("0 running", "no swarm task"); a file there
    # that is not a Kazma store is refused either way, never migrated. A command that only ``reads`` refuses a
    # store an older Kazma made rather than migrate it under that Kazma.
    await require_store(loaded.config, missing_ok=starts, current=reads)
    # No platform is started from the CLI: results are printed here, cards need `kazma run`.
    app = await build_app(loaded, adapters=[])
    # The tasks this process runs are marked as its own: `kazma run` starting meanwhile leaves them running.
    app.swarm.store.replica = this_terminal()
    try:
        # Breakers are per process, saved for its next start: what this one shows and resets starts from the
        # saved states (every breaker showed closed here, and a reset saved "closed" over an open one unseen).
        await app.swarm.restore_breakers()
        swarm = app.conversations.swarm
        assert swarm is not None

        async def send() -> str:
            return await swarm.run(
                text, actor=str(Actor("cli", login)), platform="cli", chat="terminal", is_admin=False, context=context
            )

        answer = await send()
        click.echo(answer)
        if text.split()[:2] == ["breaker", "reset"] and "'s breaker is closed" in answer:
            click.echo(
                "(saved for the next start; a running `kazma run` keeps its own breaker until then: reset it there "
                "with /swarm breaker reset)",
                err=True,
            )
        if confirm is not None and ASK_AGAIN in answer:
            if not (confirm or (sys.stdin.isatty() and click.confirm("Run it anew?", err=True))):
                click.echo("Not retried: run it again with --yes to run it anew.", err=True)
                return 1
            answer = await send()
            click.echo(answer)
        task_id = started_task(answer)
        if task_id is not None:
            while (record := await app.swarm.wait(task_id, 90)) is not None and not record.status.terminal:
                click.echo(f"… {record.status.value}: {record.current_step}", err=True)
            if record is not None:
                output = record.result.get("output", "") if record.result else ""
                click.echo(f"{record.status.value}: {output or record.error or ''}")
                for line in ending_lines(record):  # what its tools did, the answers it kept
                    click.echo(line)
                return 0 if record.status.value in ("succeeded", "partial") else 1
        return 1 if refused or answer.startswith(_NOT_DONE) else 0
    finally:
        await app.stop()


class _Options:
    def __init__(self, login: str | None, parse_only: bool) -> None:
        self.login = login
        self.parse_only = parse_only


def _word(value: str) -> str:
    """Chat splits on whitespace, so one CLI argument must stay one word there too."""
    if not value or value != "".join(value.split()):
        raise click.BadParameter(f"{value!r} must be one word without spaces")
    return value


def _word_callback(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    return None if value is None else _word(value)


def _route_platform(value: str) -> str:
    """The platform a route names, lowercased ("" when it is no address)."""
    try:
        return Address.parse(value).platform.lower()
    except AddressError:
        return ""


def _ends_in_route(words: list[str]) -> bool:
    """Whether the words end in ``-> platform:chat``, which chat's grammar reads as the route."""
    return len(words) >= 2 and words[-2] in (ARROW, _ARROW_HELD) and _route_platform(words[-1]) in ROUTE_PLATFORMS


def _route_callback(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    value = _word_callback(ctx, param, value)
    # Without this, a --to that is not a route would silently become task text.
    platform = None if value is None else _route_platform(value)
    if platform is not None and platform not in ROUTE_PLATFORMS:
        raise click.BadParameter(f"expected PLATFORM:CHAT with platform one of {', '.join(ROUTE_PLATFORMS)}")
    return value


_to_option = click.option(
    "--to",
    metavar="PLATFORM:CHAT",
    default=None,
    callback=_route_callback,
    help=f"Post the result in another chat ({', '.join(ROUTE_PLATFORMS[:-1])} or {ROUTE_PLATFORMS[-1]}); admin only.",
)


def _help(verb: str) -> str:
    usage = USAGES[verb]
    return f"{usage.summary[0].upper()}{usage.summary[1:]} ({usage.line}). {_PENDING}"


class _SwarmGroup(click.Group):
    """The subcommands written below, and every registered pattern that has none here: its words go to the
    grammar as typed, so a new pattern reaches the terminal without a line in this file."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *(p.verb for p in registered())})

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        final_route = _ends_in_route(args)
        options = args[: args.index("--")] if "--" in args else args
        given = sum(arg == "--to" or arg.startswith("--to=") for arg in options) + (final_route and "--" not in args)
        if given > 1:
            # click keeps the last --to of several: `… --to discord:2 -> slack:C1` dropped discord:2 unsaid
            raise click.UsageError("more than one route (-> or --to): give one", ctx)
        if final_route and "--" not in args:
            # a final route is --to, which every subcommand takes (one without task words had no place for it);
            # after "--" it stays words, and the grammar reads it off the task as chat does
            args = [*args[:-2], "--to", args[-1]]
        return super().parse_args(ctx, [_held(arg) for arg in args])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        found = super().get_command(ctx, cmd_name)
        if found is not None:
            return found
        pattern = for_verb(cmd_name)
        return None if pattern is None else _pattern_command(pattern.verb)


@click.group(cls=_SwarmGroup)
@click.option(
    "--as", "login", default=None, help="Confirms who you are: recorded is cli:<the system user running this>."
)
@click.option("--parse-only", is_flag=True, help="Print the parsed command as one JSON line and stop.")
@click.pass_context
def swarm(ctx: click.Context, login: str | None, parse_only: bool) -> None:
    """Drive the swarm with the same grammar as /swarm in chat.

    Steering commands need cli:<your system login> (or its person) in approvals.approvers. Work started here
    runs in this process; its result is printed when it ends.
    """
    ctx.meta[_OPTIONS] = _Options(login, parse_only)


def _no_argument_command(verb: str) -> Callable[[str | None], None]:
    def command(to: str | None) -> None:
        _run(verb, to=to)

    return command


for _verb in ("help", "list", "history", "workers", "config"):
    swarm.command(_verb, help=_help(_verb))(_to_option(_no_argument_command(_verb)))


@swarm.command("metrics", help=_help("metrics"))
@click.argument("days", required=False, type=click.IntRange(1, 366))
@_to_option
def metrics(days: int | None, to: str | None) -> None:
    _run("metrics", *([str(days)] if days is not None else []), to=to)


@swarm.command("tasks", help=_help("tasks"))
@click.option("--worker", default=None, callback=_word_callback, help="Only tasks this worker was named in or ran.")
@_to_option
def tasks(worker: str | None, to: str | None) -> None:
    _run("tasks", *(["--worker", worker] if worker is not None else []), to=to)


@swarm.command("show", help="One task and every worker call it made (model, tools, times, tokens, cost).")
@click.argument("task_id", callback=_word_callback)
@click.option("--json", "as_json", is_flag=True, help="Print the task and its calls as one JSON object.")
def show(task_id: str, as_json: bool) -> None:
    loaded = _context().load()
    sys.exit(asyncio.run(_show(loaded, task_id, as_json)))


async def _show(loaded: LoadedConfig, task_id: str, as_json: bool) -> int:
    await require_store(loaded.config, current=True)
    app = await build_app(loaded, adapters=[])
    try:
        record = await app.swarm.task(task_id)
        if record is None:
            click.echo(f"no swarm task {task_id!r}", err=True)
            return 1
        calls = await app.swarm.store.calls(task_id)
        if not as_json:
            click.echo(
                await app.conversations.swarm.run(  # type: ignore[union-attr]
                    f"status {task_id}", actor="cli:show", platform="cli", chat="terminal", is_admin=False
                )
            )
            return 0
        click.echo(json.dumps(task_json(record, calls), ensure_ascii=False, indent=2))
        return 0
    finally:
        await app.stop()


def _context_file(_ctx: click.Context, _param: click.Parameter, value: Path | None) -> str:
    """The file's text, refused over the context limit before anything is built (the limit named)."""
    if value is None:
        return ""
    try:
        text = value.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise click.BadParameter(f"{value.name} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        check_context(text, what=f"context file {value.name}")
    except LimitExceeded as exc:
        raise click.BadParameter(str(exc)) from None
    return text


def _start_options(function: Callable[..., None]) -> Callable[..., None]:
    function = click.option(
        "--expect", default=None, callback=_word_callback, help="json, or a schema from swarm.schemas."
    )(function)
    function = click.option(
        "--context-file",
        "context",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        callback=_context_file,
        help="A file every worker gets with the task, as data (at most 256 KiB).",
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
def dispatch(
    worker: str, task: tuple[str, ...], to: str | None, expect: str | None, deadline: int | None, context: str
) -> None:
    _run("dispatch", worker, *_option_words(expect, deadline), *task, to=to, context=context)


@swarm.command("broadcast", help=_help("broadcast"))
@click.argument("task", nargs=-1, required=True)
@_to_option
@_start_options
def broadcast(task: tuple[str, ...], to: str | None, expect: str | None, deadline: int | None, context: str) -> None:
    _run("broadcast", *_option_words(expect, deadline), *task, to=to, context=context)


@swarm.command("pipeline", help=_help("pipeline"))
@click.argument("stages", metavar="PRESET|W1,W2,…", callback=_word_callback)
@click.argument("task", nargs=-1, required=True)
@_to_option
@_start_options
def pipeline(
    stages: str, task: tuple[str, ...], to: str | None, expect: str | None, deadline: int | None, context: str
) -> None:
    _run("pipeline", stages, *_option_words(expect, deadline), *task, to=to, context=context)


@swarm.command("fanout", help=_help("fanout"))
@click.argument("workers", metavar="W1,W2,…", callback=_word_callback)
@click.argument("task", nargs=-1, required=True)
@_to_option
@_start_options
@click.option(
    "--strategy",
    type=click.Choice(STRATEGIES),
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
    context: str,
) -> None:
    _run("fanout", workers, *_option_words(expect, deadline, strategy), *task, to=to, context=context)


@swarm.command("consult", help=_help("consult"))
@click.argument("workers", metavar="W1,W2,…", callback=_word_callback)
@click.argument("question", nargs=-1, required=True)
@_to_option
@_start_options
def consult(
    workers: str, question: tuple[str, ...], to: str | None, expect: str | None, deadline: int | None, context: str
) -> None:
    _run("consult", workers, *_option_words(expect, deadline), *question, to=to, context=context)


@swarm.command("conditional", help=_help("conditional"))
@click.argument("router", callback=_word_callback)
@click.argument("routes", metavar="BRANCH=WORKER,…", callback=_word_callback)
@click.argument("task", nargs=-1, required=True)
@_to_option
@_start_options
def conditional(
    router: str,
    routes: str,
    task: tuple[str, ...],
    to: str | None,
    expect: str | None,
    deadline: int | None,
    context: str,
) -> None:
    _run("conditional", router, routes, *_option_words(expect, deadline), *task, to=to, context=context)


@swarm.command("breaker", help=_help("breaker"))
@click.argument("action", type=click.Choice(["reset"]))
@click.argument("worker", callback=_word_callback)
@_to_option
def breaker(action: str, worker: str, to: str | None) -> None:
    _run("breaker", action, worker, to=to)


def _pattern_command(verb: str) -> click.Command:
    def command(words: tuple[str, ...], to: str | None, expect: str | None, deadline: int | None, context: str) -> None:
        _run(verb, *_option_words(expect, deadline), *words, to=to, context=context)

    command = _start_options(_to_option(click.argument("words", nargs=-1, required=True)(command)))
    return click.command(verb, help=_help(verb))(command)


def _task_command(verb: str) -> Callable[[str, str | None], None]:
    def command(task_id: str, to: str | None) -> None:
        _run(verb, task_id, to=to)

    return command


for _verb in ("cancel", "approve", "reject"):
    swarm.command(_verb, help=_help(_verb))(
        click.argument("task_id", callback=_word_callback)(_to_option(_task_command(_verb)))
    )


@swarm.command("retry", help=_help("retry"))
@click.argument("task_id", callback=_word_callback)
@_to_option
@click.option(
    "--yes",
    is_flag=True,
    help="Run it anew without asking, where a retry must be confirmed (its outcome unknown, or its tools ran).",
)
def retry(task_id: str, to: str | None, yes: bool) -> None:
    _run("retry", task_id, to=to, confirm=yes)
