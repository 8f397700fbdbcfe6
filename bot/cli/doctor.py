"""``kazma doctor``: check what a running bus would depend on and say what is wrong."""

from __future__ import annotations

import os
from pathlib import Path

import aiosqlite
import httpx

from kazma.approvals.honesty import reveal_line
from kazma.approvals.tool_names import MCP_TOOL_RULE, mcp_tool_name_problem
from kazma.bot.cli.audit_checks import check_audit
from kazma.bot.cli.checks import Check, Level
from kazma.bot.cli.decision_checks import check_decisions
from kazma.bot.cli.platform_checks import check_platforms, console_checks
from kazma.bot.cli.policy_checks import check_policy_passkeys
from kazma.bot.store import (
    open_store,
    pg_schema_recorded,
    require_existing_store,
    schema_lag,
    sqlite_schema_recorded,
    store_for_command,
)
from kazma.config import LoadedConfig, platform_statuses
from kazma.config.errors import ConfigError
from kazma.config.models import MCPServerConfig, ModelConfig
from kazma.config.store.backend import backend_of
from kazma.config.store.database import schema_versions, transaction
from kazma.engine.tools.mcp_launch import LaunchRefused, ServerPlaces, places_for
from kazma.engine.tools.mcp_stdio import StderrTail
from kazma.engine.tools.mcp_tools import list_server_tools
from kazma.engine.tools.sandbox import resolve_sandbox

__all__ = ["Check", "Level", "run_checks"]


async def run_checks(loaded: LoadedConfig, *, model_timeout: float = 5.0, platform_timeout: float = 5.0) -> list[Check]:
    checks = [Check("config", Level.OK, f"{loaded.source or 'kazma.yaml'} is valid")]
    answers = await check_platforms(loaded, timeout=platform_timeout)  # every platform asked at once
    for status in platform_statuses(loaded):
        if status.enabled:
            checks.append(Check(f"platform.{status.name}", Level.OK, f"on ({status.reason})"))
        elif status.name not in loaded.platforms_without_secrets:
            checks.append(Check(f"platform.{status.name}", Level.OK, f"off: {status.reason}"))
        # Loaded without a secret the file reads (not exported here): one failed check; the rest still run.
        checks.extend(
            Check(
                f"platform.{status.name}",
                Level.FAIL,
                f"environment variable {var} is not set ({where} reads it): export it, or write ${{{var}:-}} "
                "to leave the platform off",
            )
            for where, var in loaded.unset_secrets
            if where.split(".")[1] == status.name
        )
        checks.extend(answers.get(status.name, []))
        checks.extend(Check(f"platform.{status.name}", Level.WARN, w) for w in status.warnings)
    checks.extend(console_checks(loaded))
    checks.extend(Check("config", Level.WARN, warning) for warning in loaded.config.warnings())
    checks.append(check_sandbox(loaded))
    store, store_ok = await check_store(loaded)
    checks.append(store)
    # Only a store that is there is read: none yet has nothing to check, and reading must not make it.
    checks.extend(await check_decisions(loaded, store_ok=store_ok))
    checks.extend(await check_audit(loaded, store_ok=store_ok))
    if store_ok:
        checks.extend(await check_policy_passkeys(loaded))
    if loaded.config.store.backend == "postgresql" and store_ok:
        checks.append(await check_replicas(loaded))
    checks.append(await check_model(loaded, wait_seconds=model_timeout))
    for name, model in loaded.config.models.items():
        checks.append(await check_endpoint(model, f"model.{name}", wait_seconds=model_timeout, key=f"models.{name}"))
    places = places_for(loaded.config, config_file=loaded.source)
    for name, server in loaded.config.mcp_servers.items():
        checks.append(await check_mcp_server(name, server, places=places))
    return checks


async def check_mcp_server(name: str, server: MCPServerConfig, *, places: ServerPlaces | None = None) -> Check:
    """Say how the server runs (sandboxed, unsandboxed, refused), then start it as `kazma run` would and list
    its tools."""
    where = server.url or " ".join([server.command, *server.args])
    if server.url:
        mode = "over HTTP (Kazma does not run it)"
    elif server.sandbox == "none":
        mode = f"runs unsandboxed on this host (mcp_servers.{name}.sandbox: none; every card of its tools says so)"
    else:
        mode = f"sandboxed (bubblewrap, network {'on' if server.network else 'off'})"
    stderr = StderrTail()
    try:
        tools = await list_server_tools(name, server, places=places, stderr=stderr)
    except LaunchRefused as exc:
        return Check(f"mcp.{name}", Level.FAIL, f"not started: {exc}")
    except Exception as exc:
        said = stderr.last_line()
        hint = (
            f"; in its sandbox it sees only the system, its working directory and what it is given: list the "
            f"folders it needs under mcp_servers.{name}.read_only or .writable"
            if server.command and server.sandbox == "bwrap"
            else ""
        )
        return Check(
            f"mcp.{name}",
            Level.FAIL,
            f"{where[:200]}: {mode}, could not list its tools ({_reason(exc)})"
            + (f"; its last words: {said}" if said else "")
            + hint,
        )
    kept = sorted(tool for tool in tools if mcp_tool_name_problem(tool) is None)
    listed = ", ".join(f"{name}/{tool}" for tool in kept) or "no tools"
    level = Level.WARN if server.command and server.sandbox == "none" else Level.OK
    refused = [(tool, problem) for tool in tools if (problem := mcp_tool_name_problem(tool)) is not None]
    if not refused:
        return Check(f"mcp.{name}", level, f"{mode}; {len(kept)} tools: {listed}")
    why = "; ".join(f"'{reveal_line(tool)[:80]}' ({problem})" for tool, problem in refused[:5])
    more = f"; and {len(refused) - 5} more" if len(refused) > 5 else ""
    return Check(
        f"mcp.{name}",
        Level.WARN,
        f"{mode}; {len(kept)} tools: {listed}; {len(refused)} refused, left out of every agent's tools: {why}{more}. "
        f"{MCP_TOOL_RULE[0].upper()}{MCP_TOOL_RULE[1:]}.",
    )


def _reason(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _reason(exc.exceptions[0])
    return f"{type(exc).__name__}: {exc}"[:300]


def check_sandbox(loaded: LoadedConfig) -> Check:
    """How ``shell`` would run here: sandboxed, unsandboxed (a warning), or refused (a failure)."""
    sandbox = resolve_sandbox(loaded.config.tools.sandbox)
    if sandbox.refuses:
        return Check("sandbox", Level.FAIL, sandbox.refusal or sandbox.describe())
    if not sandbox.active:
        unsandboxed = "shell commands run unsandboxed on this host (every shell card says so)"
        if loaded.config.tools.sandbox == "none":  # chosen: say so, without telling to choose it again
            return Check("sandbox", Level.WARN, f"{unsandboxed}: tools.sandbox is none")
        why = f" ({sandbox.problem})" if sandbox.problem else ""
        return Check(
            "sandbox",
            Level.WARN,
            f"{unsandboxed}{why}: install bubblewrap (apt-get install bubblewrap) "
            "or set tools.sandbox: none to accept it",
        )
    network = "on" if loaded.config.tools.shell_network else "off"
    return Check("sandbox", Level.OK, f"shell commands run in bubblewrap (network {network})")


async def check_store(loaded: LoadedConfig) -> tuple[Check, bool]:
    """The store check, and whether there is a store the later checks (seals, audit chain, passkeys) may read:
    none yet is said, never made, and leaves them nothing to read."""
    if loaded.config.store.backend == "postgresql":
        return await check_pg_store(loaded)
    path = loaded.config.store.path
    if str(path) != ":memory:" and not path.exists():
        return missing_store_check(path), False
    try:
        require_existing_store(loaded.config)
        older = _older_store_check(loaded, str(path), sqlite_schema_recorded(path))
        if older is not None:
            return older, False
        conn = await open_store(loaded.config)
    except ConfigError as exc:
        return Check("store", Level.FAIL, exc.problems[0].message), False
    except Exception as exc:
        return Check("store", Level.FAIL, f"{path}: cannot open: {exc}"), False
    try:
        async with transaction(conn):  # takes the write lock: proves the file is writable now
            versions = await schema_versions(conn)
    except Exception as exc:
        return Check("store", Level.FAIL, f"{path}: not writable: {exc}"), False
    finally:
        await conn.close()
    schema = ", ".join(f"{k} v{v}" for k, v in sorted(versions.items())) or "no tables yet"
    return Check("store", Level.OK, f"{path}: writable ({schema})"), True


def _older_store_check(loaded: LoadedConfig, where: str, recorded: set[tuple[str, int]] | None) -> Check | None:
    """A store an older Kazma made, said and left as it is: opening it here migrated it, under the older Kazma
    that may still be running on it (checked before an upgrade, doctor upgraded the store itself)."""
    lag = None if recorded is None else schema_lag(loaded.config, recorded)
    if lag is None:
        return None
    # Not a failure: the next `kazma run` (or `kazma store migrate`) upgrades it, as after every update.
    return Check(
        "store",
        Level.WARN,
        f"{where}: {lag}: kazma run (or kazma store migrate) upgrades it; not read further until then",
    )


def missing_store_check(path: Path) -> Check:
    """No store yet: said, not made. Creating it here answered "writable" for a mistyped store.path (and every
    later read-only command then found that empty store instead of refusing the path)."""
    folder = next((p for p in path.parents if p.exists()), None)
    if folder is not None and not folder.is_dir():
        return Check("store", Level.FAIL, f"{path}: cannot be created: {folder} is a file, not a folder")
    if folder is not None and not os.access(folder, os.W_OK | os.X_OK):
        return Check("store", Level.FAIL, f"{path}: cannot be created: {folder} is not writable by this user")
    # OK, as before every first start (the first steps run doctor before it); the path is named to be checked.
    return Check(
        "store",
        Level.OK,
        f"no Kazma store at {path} yet: kazma run creates it there; if Kazma has run before, store.path is not "
        "its store",
    )


async def check_pg_store(loaded: LoadedConfig) -> tuple[Check, bool]:
    """Reachable, migrated, and writable by this user on a primary (not a read-only standby)."""
    where = loaded.config.store.redacted_url
    try:
        recorded = await pg_schema_recorded(loaded.config)
        if recorded is None:
            # Said, not made: doctor once applied Kazma's schema to whatever database store.url named.
            return Check("store", Level.OK, f"no Kazma store in {where} yet: kazma run creates it there"), False
        older = _older_store_check(loaded, where, recorded)
        if older is not None:
            return older, False
        async with store_for_command(loaded.config, read_only=True) as opened:
            store = backend_of(opened)
            rows = await store.all("SELECT component, MAX(version) FROM kazma_schema GROUP BY component")
            row = await store.one(
                "SELECT pg_is_in_recovery(), has_table_privilege('approval_requests', 'UPDATE'),"
                " current_setting('server_version')"
            )
    except ConfigError as exc:
        # Its own line already names the server (without the password) and what it answered; wrapped again it
        # said the URL twice around "kazma.yaml: store.url:", as if the configuration file were the problem.
        return Check("store", Level.FAIL, exc.problems[0].message), False
    except Exception as exc:
        return Check("store", Level.FAIL, f"{where}: cannot open: {str(exc).strip() or type(exc).__name__}"), False
    standby, may_update, version = bool(row[0]), bool(row[1]), str(row[2])
    if standby:
        return Check("store", Level.FAIL, f"{where}: a read-only standby; point store.url at the primary"), False
    if not may_update:
        return Check("store", Level.FAIL, f"{where}: this user may not update approval_requests"), False
    schema = ", ".join(f"{k} v{v}" for k, v in sorted((str(r[0]), int(r[1])) for r in rows)) or "no tables yet"
    return Check("store", Level.OK, f"{where}: PostgreSQL {version}, writable ({schema})"), True


async def check_replicas(loaded: LoadedConfig) -> Check:
    """Which `kazma run` replicas share the database now, and which one leads (as the server says)."""
    from kazma.config.store.leader import lock_key
    from kazma.config.store.replicas import lease_holder, live_replicas

    try:
        async with store_for_command(loaded.config, read_only=True) as opened:
            assert not isinstance(opened, aiosqlite.Connection)
            alive = sorted(await live_replicas(opened.pool))
            leader = await lease_holder(opened.pool, lock_key("kazma"))
    except Exception as exc:
        return Check("replicas", Level.FAIL, f"cannot ask the database: {str(exc).strip() or type(exc).__name__}")
    if not alive:
        return Check("replicas", Level.OK, "none running")
    named = ", ".join(f"{name} (leader)" if name == leader else name for name in alive)
    if leader is None:
        return Check("replicas", Level.WARN, f"{named}: none holds the lease yet (one takes it within seconds)")
    return Check("replicas", Level.OK, named)


async def check_model(loaded: LoadedConfig, *, wait_seconds: float) -> Check:
    return await check_endpoint(loaded.config.model, "model", wait_seconds=wait_seconds)


async def check_endpoint(model: ModelConfig, label: str, *, wait_seconds: float, key: str = "model") -> Check:
    """The endpoint's model list. A failure names the setting to change (``key``: ``model`` or
    ``models.<name>``): the README promises each problem's fix, and a first run with no model server met
    "unreachable (ConnectError: All connection attempts failed)" and nothing more."""
    url = model.base_url.rstrip("/") + "/models"
    headers = {"Authorization": f"Bearer {model.api_key}"} if model.api_key else {}
    start = f"start the model server there, or set {key}.base_url to an OpenAI-compatible one that runs"
    try:
        async with httpx.AsyncClient(timeout=wait_seconds) as client:
            response = await client.get(url, headers=headers)
    except httpx.TimeoutException:
        return Check(
            label, Level.FAIL, f"{url}: no answer within {wait_seconds:g} s: {start} (--model-timeout waits longer)"
        )
    except httpx.HTTPError as exc:
        return Check(label, Level.FAIL, f"{url}: unreachable ({type(exc).__name__}: {exc}): {start}")
    if response.status_code in (401, 403):
        return Check(
            label,
            Level.FAIL,
            f"{url}: the server rejected the API key (HTTP {response.status_code}): check {key}.api_key",
        )
    if response.status_code >= 500:
        # the server's own failure (a model still loading): its base_url was right to reach it
        return Check(
            label,
            Level.FAIL,
            f"{url}: HTTP {response.status_code}: the model server failed to answer: see its log, then run doctor "
            "again",
        )
    if response.status_code >= 400:
        return Check(
            label,
            Level.FAIL,
            f"{url}: HTTP {response.status_code}: is {key}.base_url the API's base (usually ending in /v1)?",
        )
    try:
        answer = response.json()
    except ValueError:
        return Check(
            label, Level.FAIL, f"{url}: answered, but not with JSON: is {key}.base_url an OpenAI-compatible API?"
        )
    listed_models = answer.get("data", []) if isinstance(answer, dict) else None
    if not isinstance(listed_models, list):
        # a JSON list, or a "data" that is null, ended doctor in AttributeError / TypeError, not this line
        return Check(
            label,
            Level.FAIL,
            f"{url}: answered, but not with a model list: is {key}.base_url an OpenAI-compatible API?",
        )
    names = {str(item.get("id")) for item in listed_models if isinstance(item, dict)}
    if names and model.name not in names:
        listed = ", ".join(sorted(names)[:5])
        return Check(
            label,
            Level.WARN,
            f"{url}: reachable, but model {model.name!r} is not listed ({listed}): set {key}.name to one it lists",
        )
    return Check(label, Level.OK, f"{url}: reachable, model {model.name!r}")
