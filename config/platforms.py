"""Which platforms a configuration turns on, and why the others stay off."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kazma.config.loader import LoadedConfig
from kazma.config.models import KazmaConfig
from kazma.config.registry import CHAT_PLATFORMS, WEB

PLATFORMS = tuple(CHAT_PLATFORMS)


@dataclass(frozen=True)
class PlatformStatus:
    name: str
    enabled: bool
    reason: str
    warnings: list[str] = field(default_factory=list)


def platform_statuses(loaded: LoadedConfig) -> list[PlatformStatus]:
    return [platform_status(loaded, name) for name in PLATFORMS]


def enabled_platforms(loaded: LoadedConfig) -> list[str]:
    return [s.name for s in platform_statuses(loaded) if s.enabled]


def platform_status(loaded: LoadedConfig, name: str) -> PlatformStatus:
    cfg = loaded.config
    spec = CHAT_PLATFORMS[name]
    if not spec.token(cfg.platforms):
        variables = loaded.references.get(f"platforms.{name}.{spec.token_key}", [])
        hint = f" (set {' or '.join(variables)})" if variables else ""
        return PlatformStatus(name, False, f"{spec.token_key} is empty{hint}")
    warnings: list[str] = []
    if not cfg.roster.approvers_for(name):
        warnings.append(
            f"no approvers for {name}: approval presses there will be refused "
            f"(add '{name}:<user id>' to approvals.approvers or platforms.{name}.admins)"
        )
    if spec.home(cfg.platforms) is None:
        warnings.append(f"{spec.home_key} is not set: approval cards and reports have nowhere to go")
    return PlatformStatus(name, True, spec.transport(spec.section(cfg.platforms)), warnings)


def is_loopback(url: str) -> bool:
    """The URL's host is this machine's loopback (nobody else can open it)."""
    host = (urlsplit(url).hostname or "").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def console_warnings(config: KazmaConfig) -> list[str]:
    """The web console is served by every ``kazma run``: can anyone decide there, can chats link to it, and does
    it know who logs in behind its proxy?"""
    found: list[str] = []
    if not config.roster.approvers_for(WEB):
        found.append(
            "no web approvers: every Approve or Deny pressed in the console is refused (add a person with a "
            "console identity, people.<name>.web, to approvals.approvers; then `kazma people invite <name>`)"
        )
    nobodys = sorted(a for a in config.roster.approvers_for(WEB) if config.people.person_of(a) is None)
    if nobodys:
        found.append(
            f"{_listed(nobodys)} {'is an approver' if len(nobodys) == 1 else 'are approvers'} in the console, but "
            "no person under people: has that identity: nobody can enrol a passkey for it, so it decides nothing "
            "(add people.<name>: {web: <login>}; README: Web console)"
        )
    on = [spec.title for spec in CHAT_PLATFORMS.values() if spec.token(config.platforms)]
    if on and is_loopback(config.web.public_url):
        found.append(
            f"web.public_url is {config.web.public_url} while {_listed(on)} {'is' if len(on) == 1 else 'are'} "
            "on: the links on chat cards point at this machine's loopback, which nobody in a chat can open "
            "(set web.public_url to the https:// address people reach the console at; README: Running in production)"
        )
    if config.web.public_url.startswith("https://") and not config.web.trusted_proxies:
        found.append(
            "web.public_url is https:// (a TLS proxy stands in front of Kazma) but web.trusted_proxies is empty: "
            "every login seems to come from the proxy's address, so one stranger's wrong tokens slow everyone's "
            "wrong tokens and the log names the proxy instead of the person. Name the proxy's address in "
            "web.trusted_proxies (README: Behind a TLS reverse proxy)"
        )
    return found
