"""Which platforms a configuration turns on, and why the others stay off."""

from __future__ import annotations

from dataclasses import dataclass, field

from kazma.config.loader import LoadedConfig
from kazma.config.registry import CHAT_PLATFORMS

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


def _transport(loaded: LoadedConfig, name: str) -> str:
    platforms = loaded.config.platforms
    if name == "telegram":
        return f"{platforms.telegram.mode} mode"
    if name == "slack":
        return "Socket Mode" if platforms.slack.app_token else "HTTP events"
    return "gateway"


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
    return PlatformStatus(name, True, _transport(loaded, name), warnings)
