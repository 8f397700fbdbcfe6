"""``kazma init``: a first ``kazma.yaml`` that works, asked for on a terminal or given by flags."""

from __future__ import annotations

import getpass
import os
import re
import shlex
import shutil
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import click
from ruamel.yaml.error import YAMLError

from kazma.bot.cli.cli_identity import system_login
from kazma.bot.cli.context import Context
from kazma.bot.cli.init_config import (
    DEFAULT_MODEL_URL,
    DEFAULT_PUBLIC_URL,
    PLACEHOLDER_SECRETS,
    WEB_LOGIN,
    InitAnswers,
    Presence,
    render,
)
from kazma.bot.cli.init_merge import merge_into
from kazma.config import ConfigError, load_config_text
from kazma.config.address import Actor
from kazma.config.loader import resolve_path
from kazma.config.models import lower_scheme
from kazma.config.registry import CHAT_PLATFORMS

EXIT_EXISTS = 1
_TITLES = {name: spec.title for name, spec in CHAT_PLATFORMS.items()}
# The platforms init offers (an entry says what to ask), and the ways each one's events can arrive.
OFFERED = tuple(name for name, spec in CHAT_PLATFORMS.items() if spec.init is not None)
_MODES = {
    name: tuple(mode.name for mode in spec.init.modes) if spec.init else () for name, spec in CHAT_PLATFORMS.items()
}


def _flag(platform: str, what: str) -> str:
    """The keyword click hands the flag ``--<platform>-<what>`` under."""
    return f"{platform}_{what}"


def _platform_options(command: Callable[..., None]) -> Callable[..., None]:
    """Each offered platform's flags, as its registry entry describes them: ``--<platform>-user``,
    ``--<platform>-<chat>`` (its own word for a chat), and ``--<platform>-mode`` where its events can arrive in
    more than one way."""
    for name in reversed(OFFERED):
        spec = CHAT_PLATFORMS[name]
        setup = spec.init
        assert setup is not None
        if len(setup.modes) > 1:
            choice = click.Choice(list(_MODES[name]))
            command = click.option(f"--{name}-mode", type=choice, default=None, help=setup.mode_flag_help)(command)
        command = click.option(f"--{name}-{spec.chat_word}", default=None, help=setup.chat_flag_help)(command)
        command = click.option(f"--{name}-user", default=None, help=setup.user_flag_help)(command)
    return command


def _mode(platform: str, given: str | None, ask: bool) -> str | None:
    """How the platform's events arrive: the flag's, else asked on a terminal, else its first (None: the default)."""
    if given is not None or not ask or len(_MODES[platform]) < 2:
        return given
    setup = CHAT_PLATFORMS[platform].init
    assert setup is not None
    return str(click.prompt(setup.mode_prompt, type=click.Choice(list(_MODES[platform])), default=_MODES[platform][0]))


def _user_id(platform: str) -> Callable[[str], str]:
    spec = CHAT_PLATFORMS[platform]

    def check(value: str) -> str:
        value = value.strip()
        if not spec.is_user_id(value):
            raise click.BadParameter(spec.init.user_hint if spec.init else spec.user_id_hint)
        return value

    return check


def _chat_id(platform: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        value = value.strip()
        if value and not CHAT_PLATFORMS[platform].is_chat_id(value):
            raise click.BadParameter(CHAT_PLATFORMS[platform].chat_id_hint)
        return value

    return check


def _login(value: str) -> str:
    value = value.strip()
    if not WEB_LOGIN.fullmatch(value):
        raise click.BadParameter("1 to 32 letters, digits, '.', '_' or '-'")
    return value


def _url(value: str) -> str:
    value = value.strip().rstrip("/")
    if not re.match(r"^https?://[^\s/]+", value, re.IGNORECASE):  # a scheme is any case: HTTPS:// too
        raise click.BadParameter("an http(s) URL, e.g. https://kazma.example.org")
    return lower_scheme(value)


def _platforms(value: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(word.strip().lower() for word in re.split(r"[,\s]+", value) if word.strip()))
    unknown = [name for name in names if name not in OFFERED]
    if unknown:
        raise click.BadParameter(f"unknown {', '.join(unknown)} (choose from {', '.join(OFFERED)})")
    return names


def _default_login() -> str:
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        return "admin"
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "", name)[:32]
    return cleaned or "admin"


@click.command("init")
@click.argument("path", required=False, type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--platform",
    "platforms",
    multiple=True,
    type=click.Choice(list(OFFERED)),
    help="A chat platform to connect (repeat for several). None: the web console alone.",
)
@click.option("--web-login", default=None, help="Your name in the web console (becomes the approver web:<name>).")
@click.option("--public-url", default=None, help="Where people open the console; chat cards link there.")
@click.option("--model-url", default=None, help=f"OpenAI-compatible API base (default {DEFAULT_MODEL_URL}).")
@_platform_options
@click.option(
    "--interactive/--no-input",
    default=None,
    help="Ask for what the flags do not say (default: when standard input is a terminal).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Change an existing file: keep everything it says, add what these answers add (new platforms, your "
    "identities), and keep a dated copy of the old one beside it.",
)
@click.pass_obj
def init(
    obj: Context,
    /,
    path: Path | None,
    platforms: tuple[str, ...],
    web_login: str | None,
    public_url: str | None,
    model_url: str | None,
    interactive: bool | None,
    force: bool,
    **given: str | None,
) -> None:
    """Write a commented kazma.yaml in which you are an approver everywhere, then say what to run next.

    On a terminal it asks for whatever the flags leave out: the platforms, your identity on each, the
    chats to serve, the console's public URL. Secrets are never written: the file reads them from the
    environment (${TELEGRAM_BOT_TOKEN}, …). An existing file is kept unless --force is given.
    """
    target = path or resolve_path(obj.config_path)
    if target.exists() and not force:
        click.echo(f"{target} already exists; nothing was written (--force adds to it, keeping a copy)", err=True)
        sys.exit(EXIT_EXISTS)
    ask = sys.stdin.isatty() if interactive is None else interactive
    chosen = platforms
    if ask and not chosen:
        chosen = click.prompt(
            f"Chat platforms to connect ({', '.join(OFFERED)}; comma-separated; empty: the web console alone)",
            default="",
            show_default=False,
            value_proc=_platforms,
        )
    # --force keeps the person's file, and who they are in it: without --web-login they stay the person their
    # file names for this system user (it was the system user's name, whose cli: identity the file gives to them,
    # and nothing was written but "cli:root is claimed twice").
    file_login = _file_login(target) if force and target.exists() else None
    login = _answer(web_login, ask, "Your name in the web console", _login, default=file_login or _default_login())
    presences: dict[str, Presence] = {}
    for platform in chosen:
        user, chat = given[_flag(platform, "user")], given[_flag(platform, CHAT_PLATFORMS[platform].chat_word)]
        title = _TITLES[platform]
        user = _answer(user, ask, f"Your {title} user id", _user_id(platform), flag=f"--{platform}-user")
        if chat is None and ask:
            chat = click.prompt(
                f"The {title} chat Kazma serves (empty: not known yet)",
                default="",
                show_default=False,
                value_proc=_chat_id(platform),
            )
        presences[platform] = Presence(user, _chat_id(platform)(chat or "") or None)
    # a platform with one way its events arrive (matrix: sync) has no --<platform>-mode flag to read
    modes = {
        platform: _mode(platform, given.get(_flag(platform, "mode")), ask) for platform in chosen if _MODES[platform]
    }
    url_hint = " (chat cards link here)" if chosen else ""
    public = _answer(public_url, ask, f"The console's public URL{url_hint}", _url, default=DEFAULT_PUBLIC_URL)
    model = _answer(model_url, ask, "The model server (OpenAI-compatible)", _url, default=DEFAULT_MODEL_URL)
    answers = InitAnswers(
        login,
        public_url=public,
        model_url=model,
        modes={platform: mode for platform, mode in modes.items() if mode is not None},
        cli_login=system_login(),
        present=presences,
    )
    try:
        text = render(answers)
    except ConfigError as exc:  # flags the template cannot turn into a valid file: say which, write nothing
        for line in exc.lines:
            click.echo(line, err=True)
        sys.exit(2)
    signed_in_at = answers.public_url
    if force and target.exists():
        written = _merge_and_back_up(target, text, answers, file_login=file_login)
        # --force keeps the file's web.public_url: the next steps name the one it has, and a different one asked
        # for is said to be left out (it was "sign in at <the flag's URL>", which the file did not say)
        kept, asked = _public_url_of(written), _public_url_of(text)
        if kept is not None:
            signed_in_at = kept
            if public_url is not None and asked is not None and kept != asked:
                click.echo(
                    f"Kept web.public_url: {kept}, as your file says; --public-url {public_url} was not applied: "
                    f"change web.public_url in {target} if it should be"
                )
    else:
        _write(target, text, force=force)
    identities = ", ".join(actor for actor, _ in answers.approvers)
    click.echo(f"Wrote {target}: you are {answers.person}, an approver as {identities}.")
    click.echo("Next:")
    for command, why in next_commands(answers, target, public_url=signed_in_at):
        click.echo(f"  {command:<44} # {why}")


def _answer(
    value: str | None,
    ask: bool,
    prompt: str,
    check: Callable[[str], str],
    *,
    default: str | None = None,
    flag: str | None = None,
) -> str:
    if value is not None:
        try:
            return check(value)
        except click.BadParameter as exc:
            raise click.UsageError(f"{flag or prompt}: {exc.message}") from None
    if ask:
        return str(click.prompt(prompt, default=default, value_proc=check))
    if default is None:
        raise click.UsageError(f"{flag} is required here (or run `kazma init` on a terminal to be asked)")
    return default


def _write(target: Path, text: str, *, force: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(target, flags, 0o644)  # it holds no secret: only ${VAR} references to them
    except FileExistsError:  # created since we looked: still never overwritten without --force
        click.echo(f"{target} already exists; nothing was written (--force adds to it, keeping a copy)", err=True)
        sys.exit(EXIT_EXISTS)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)


def _public_url_of(text: str) -> str | None:
    """The console's public URL a file's text gives, as Kazma reads it (None: it does not load here)."""
    try:
        loaded = load_config_text(text, environ={**os.environ, **PLACEHOLDER_SECRETS}, platform_secrets=False)
    except ConfigError:
        return None
    return loaded.config.web.public_url


def _file_login(target: Path) -> str | None:
    """The console login the file gives the person whose ``cli:`` identity is this system user: who runs
    ``kazma init`` here, as the file says (None: it names no such person with a console login, or does not load)."""
    try:
        text = target.read_text(encoding="utf-8")
        loaded = load_config_text(text, environ={**os.environ, **PLACEHOLDER_SECRETS}, platform_secrets=False)
    except (OSError, UnicodeDecodeError, ConfigError):
        return None
    people = loaded.config.people
    person = people.person_of(str(Actor("cli", system_login())))
    found = people.person(person) if person is not None else None
    logins = [Actor.parse(identity).user for identity in found.on("web")] if found is not None else []
    return logins[0] if logins else None


def _merge_and_back_up(target: Path, text: str, answers: InitAnswers, *, file_login: str | None = None) -> str:
    """``--force`` on an existing file: the person's file with what the answers add, after a dated copy of it.
    Returns the text written."""
    try:
        old = target.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        click.echo(f"{target} cannot be read ({exc}); nothing was written", err=True)
        sys.exit(2)
    try:
        merged = merge_into(old, text, person=answers.person)
    except YAMLError as exc:
        # It was "held no settings to keep: written anew": one typo replaced every setting (the copy kept them).
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        click.echo(f"{target}: {where}invalid YAML: {problem}; fix it and run again, nothing was written", err=True)
        sys.exit(2)
    if merged is not None:
        try:
            # Their file may read variables of its own: validate as `kazma run` would here, platforms aside.
            load_config_text(merged.text, name=str(target), environ={**os.environ, **PLACEHOLDER_SECRETS},
                             platform_secrets=False)  # fmt: skip
        except ConfigError as exc:
            click.echo(f"{target}: the file with your answers merged in would not load; nothing was written:", err=True)
            for line in exc.lines:
                click.echo(f"  {line}", err=True)
            if file_login is not None and file_login != answers.web_login.lower():
                click.echo(f"  you are web:{file_login} in {target}: leave --web-login out, or pass --web-login "
                           f"{file_login}", err=True)  # fmt: skip
            sys.exit(2)
        text = merged.text
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    backup = target.with_name(f"{target.name}.{stamp}.bak")
    number = 1
    while backup.exists():  # two --force runs in one second: the second copy overwrote the first, the original
        number += 1
        backup = target.with_name(f"{target.name}.{stamp}-{number}.bak")
    shutil.copy2(target, backup)
    _write(target, text, force=True)
    click.echo(f"Kept a copy of the old file: {backup}")
    if merged is None:
        click.echo(f"{target} held no settings to keep: written anew")
    elif merged.added:
        click.echo(f"Kept your settings in {target}; added {', '.join(merged.added)}")
    else:
        click.echo(f"Kept your settings in {target}; these answers add nothing it does not already say")
    return text


def next_commands(answers: InitAnswers, target: Path, *, public_url: str | None = None) -> list[tuple[str, str]]:
    """The commands to run now: set the secrets (or check the file), ask the doctor, enrol a passkey, run (and sign
    in at ``public_url``, the file's, which ``--force`` may have kept over the answers')."""
    config = "" if target == Path("kazma.yaml") else f" -c {shlex.quote(str(target))}"
    if answers.secrets:
        first = ("export " + " ".join(f"{name}=…" for name in answers.secrets), "the secrets kazma.yaml reads")
    else:
        first = (f"kazma{config} config check", "what would start, and why")
    return [
        first,
        (f"kazma{config} doctor", "the file, each platform's tokens, the store, the model"),
        (
            f"kazma{config} people invite {answers.person}",
            "your passkey for the console: open the link once Kazma runs",
        ),
        (f"kazma{config} run", f"then sign in at {public_url or answers.public_url}/login with that passkey"),
    ]
