"""The commands that run Kazma itself: ``config check``, ``doctor``, ``run`` and ``demo``.

Imported only when one of them runs (see :mod:`kazma.bot.cli`).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import signal
import sys
from pathlib import Path

import click
import structlog

from kazma.adapters.admission import FileBounds
from kazma.adapters.web import WebAdapter
from kazma.approvals.model import Decision
from kazma.bot import start_gc
from kazma.bot.app import App, build_app
from kazma.bot.cli.context import Context
from kazma.bot.cli.log_options import log_settings
from kazma.bot.console.server import WebServer
from kazma.bot.logging import redact_secret
from kazma.config import LoadedConfig, failpoints, platform_statuses
from kazma.config.errors import ConfigError, Problem
from kazma.config.platforms import console_warnings

log = structlog.get_logger("kazma.cli")

EXIT_CHECK_FAILED = 1


@click.group()
def config() -> None:
    """Inspect and validate kazma.yaml."""


@config.command("check")
@click.argument("path", required=False, type=click.Path(path_type=Path, dir_okay=True))
@click.pass_obj
def config_check(obj: Context, path: Path | None) -> None:
    """Validate PATH (default: the --config file) and say which platforms would start."""
    loaded = obj.load(path, platform_secrets=True)
    source = loaded.source or Path("kazma.yaml")
    click.echo(f"{source}: valid")
    for status in platform_statuses(loaded):
        state = "on " if status.enabled else "off"
        click.echo(f"  {status.name:<9} {state}  {status.reason}")
        for warning in status.warnings:
            click.echo(f"  {'':<9} warn {warning}")
    web = loaded.config.web
    click.echo(f"  {'web':<9} on   console on {web.host}:{web.port}, linked as {web.public_url}")
    for warning in console_warnings(loaded.config):
        click.echo(f"  {'':<9} warn {warning}")
    if not any(s.enabled for s in platform_statuses(loaded)):
        click.echo("  every platform is off: `kazma run` will serve the web console alone")
    for warning in loaded.config.warnings():
        click.echo(f"  warning: {warning}")
    swarm = loaded.config.swarm
    click.echo(
        f"  swarm: {swarm.max_parallel} tasks at once, {swarm.task_concurrency} worker calls per task, "
        f"{swarm.max_parallel_workers} in the process; each worker runs with (its own settings over the swarm's):"
    )
    for name in loaded.config.agents.workers:
        click.echo(f"    {name}: {swarm.reliability(name).line()}")


@click.command()
@click.option("--model-timeout", type=float, default=5.0, show_default=True, help="Seconds to wait for the model.")
@click.option(
    "--platform-timeout", type=float, default=5.0, show_default=True, help="Seconds to wait for each platform's API."
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='One JSON object on stdout: {"checks": [{"name", "level", "detail"}, …], "failed": N, "warnings": N}.',
)
@click.pass_obj
def doctor(obj: Context, model_timeout: float, platform_timeout: float, as_json: bool) -> None:
    """Check the configuration, each platform's tokens with the platform, the store and the model endpoint."""
    from kazma.bot.cli.checks import Check
    from kazma.bot.cli.doctor import Level, run_checks  # its checks' modules: only this command needs them

    # A secret not exported is one failed check, not the end of the checklist: every other check still runs. A
    # file that cannot be loaded at all is the config check failing, said in the report's own shape (--json is
    # one object on stdout, a failed check ends 1), since none of the other checks can run without it.
    try:
        loaded = obj.load_or_raise()
    except ConfigError as exc:
        checks = [Check("config", Level.FAIL, line) for line in exc.lines]
    else:
        checks = asyncio.run(run_checks(loaded, model_timeout=model_timeout, platform_timeout=platform_timeout))
    failed = [c for c in checks if c.level is Level.FAIL]
    warned = [c for c in checks if c.level is Level.WARN]
    if as_json:
        report = {
            "checks": [{"name": c.name, "level": c.level.value, "detail": c.detail} for c in checks],
            "failed": len(failed),
            "warnings": len(warned),
        }
        click.echo(json.dumps(report, ensure_ascii=False, indent=2))
    else:
        for check in checks:
            click.echo(f"{check.level.value.upper():<4}  {check.name:<17} {check.detail}")
        click.echo(f"{len(failed)} failed, {len(warned)} {'warning' if len(warned) == 1 else 'warnings'}")
    log.info("doctor.finished", failed=len(failed), warnings=len(warned))
    if failed:
        sys.exit(EXIT_CHECK_FAILED)


@click.command()
@click.option("--poll-interval", type=click.FloatRange(0.05, 3600), default=120.0, show_default=True, hidden=True)
# For wire-level fakes only (tests, benchmarks): a real platform punishes unpaced bursts.
@click.option("--no-pacing", is_flag=True, hidden=True)
@click.pass_obj
def run(obj: Context, poll_interval: float, no_pacing: bool) -> None:
    """Start every configured platform and serve until SIGINT or SIGTERM."""
    loaded = obj.load(platform_secrets=True)
    try:
        armed = failpoints.check()
    except failpoints.FailpointSpecError as exc:
        raise click.ClickException(str(exc)) from None
    if armed:  # a chaos run (tests/chaos): said once, loudly, so nobody mistakes it for a real one
        log.warning("failpoints.armed", failpoints=armed)
    try:
        asyncio.run(_serve(loaded, poll_interval, paced=not no_pacing))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        # Another `kazma run` (or anything else) holds an address this one listens on: one line, not a traceback.
        web = loaded.config.web
        click.echo(
            f"kazma run: cannot listen: {_bind_reason(exc)}; is another `kazma run` serving it? Stop that one, or "
            f"give this one another port (web.port is {web.port})",
            err=True,
        )
        sys.exit(EXIT_CHECK_FAILED)


def _bind_reason(exc: OSError) -> str:
    text = str(exc)
    found = re.search(r"address \('?([^',]+)'?, (\d+)", text)
    if found is not None:
        return f"{found.group(1)}:{found.group(2)} is already in use"
    return exc.strerror or "address already in use"


async def _serve(loaded: LoadedConfig, poll_interval: float, *, paced: bool = True) -> None:
    config = loaded.config
    if config.store.backend == "postgresql":
        _require_shared_console_tokens(loaded)
    web = WebAdapter(files=FileBounds(max_bytes=config.files.max_bytes, max_count=config.files.max_count))
    app = await build_app(loaded, poll_interval=poll_interval, web=web, paced=paced)
    server = WebServer(
        app.console,
        web,
        host=config.web.host,
        port=config.web.port,
        token_path=config.store.path.parent / "web-token",
        operator_token=os.environ.get("KAZMA_WEB_TOKEN") or None,
        reader_token=os.environ.get("KAZMA_WEB_READER_TOKEN") or None,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def serving() -> None:
        """The platforms answer: the web console opens, and Kazma says it runs (what a start does after that, the
        orphans' cancelling and recovery's notices, no longer holds this line)."""
        await server.start()
        _say_running(app, server)
        start_gc.served()  # the collector's own thresholds from here, the start's objects frozen (kazma.bot.start_gc)

    try:
        await app.start(serving=serving)
        await stop.wait()
        log.info("app.stopping")
    finally:
        await server.stop()
        await app.stop()


def _say_running(app: App, server: WebServer) -> None:
    if server.auth is not None:
        redact_secret(server.auth.tokens.operator)
        redact_secret(server.auth.tokens.reader)
    # Generated tokens go to their 0600 files, and to the screen only when there is one: stderr is also
    # where the log goes, and a redirected stderr is a log file or the journal.
    message = server.first_start_message(show_tokens=sys.stderr.isatty())
    if message:
        click.echo(message, err=True)
    keyring = app.service.store.keyring
    if keyring is not None and keyring.generated and keyring.path is not None:
        click.echo(
            f"decision key made at {keyring.path.resolve()} (mode 0600): it seals every approval; back it up "
            "apart from the store",
            err=True,
        )
    signer = app.service.store.chain.signer
    if signer is not None and signer.keyring.generated and signer.keyring.path is not None:
        click.echo(
            f"audit key made at {signer.keyring.path.resolve()} (mode 0600): it signs the audit log's checkpoints; "
            "back it up apart from the store, and give `kazma audit public-key` to whoever verifies the log",
            err=True,
        )
    click.echo(f"kazma is running; web console at {server.url}; press Ctrl-C to stop", err=True)


def _require_shared_console_tokens(loaded: LoadedConfig) -> None:
    """Replicas must accept the same console tokens: a session opened on one is bound to the token it was
    opened with, and every other replica checks that binding. Tokens generated per replica would differ."""
    missing = [name for name in ("KAZMA_WEB_TOKEN", "KAZMA_WEB_READER_TOKEN") if not os.environ.get(name)]
    if missing:
        raise ConfigError(
            str(loaded.source or "kazma.yaml"),
            [
                Problem(
                    "store.url",
                    "with a PostgreSQL store every replica must share the console's tokens: set "
                    f"{' and '.join(missing)} to the same values on every replica (e.g. `openssl rand -hex 32`)",
                )
            ],
        )


@click.command()
@click.option(
    "--deny", is_flag=True, help="Without a terminal to type into, press Deny instead of Approve on the card."
)
@click.option(
    "--terminal",
    "terminal_only",
    is_flag=True,
    help="Play it in this terminal only (the default when no terminal is attached).",
)
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True, help="Web console port.")
@click.option("--no-browser", is_flag=True, help="Do not try to open a browser.")
@click.pass_context
def demo(ctx: click.Context, deny: bool, terminal_only: bool, port: int, no_browser: bool) -> None:
    """Play a scripted scenario end to end: no tokens, no model.

    On a terminal it serves the web console (URL and token printed, a browser
    opened when there is one) and the card can be pressed there or here; without
    one it plays in this terminal and presses the card itself.
    """
    from kazma.adapters.terminal import stdin_is_terminal
    from kazma.bot.cli.demo import run_demo  # its scenario and terminal adapter: only this command needs them

    settings = log_settings(ctx)
    if not settings.level_given:  # the transcript is the point: only problems are logged unless asked
        settings.level = "warning"
        settings.apply()
    decision = Decision.DENY if deny else Decision.APPROVE
    web = not terminal_only and stdin_is_terminal()
    try:
        ok = asyncio.run(
            run_demo(
                out=sys.stdout, decision=decision, web=web, web_port=port, open_browser=web and not no_browser,
                linger=web,
            )
        )  # fmt: skip
    except KeyboardInterrupt:
        ok = True
    sys.exit(0 if ok else 1)
