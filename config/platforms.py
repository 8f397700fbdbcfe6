"""Which platforms a configuration turns on, and why the others stay off."""

from __future__ import annotations

from dataclasses import dataclass, field

from kazma.config.loader import LoadedConfig

PLATFORMS = ("telegram", "slack", "discord")
_TOKEN_KEY = {"telegram": "token", "slack": "bot_token", "discord": "token"}


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
    key = _TOKEN_KEY[name]
    section = getattr(cfg.platforms, name)
    token: str = getattr(section, key)
    if not token:
        variables = loaded.references.get(f"platforms.{name}.{key}", [])
        hint = f" (set {' or '.join(variables)})" if variables else ""
        return PlatformStatus(name, False, f"{key} is empty{hint}")
    warnings: list[str] = []
    if not cfg.approvers_for(name):
        warnings.append(
            f"no approvers for {name}: approval presses there will be refused "
            f"(add '{name}:<user id>' to approvals.approvers or platforms.{name}.admins)"
        )
    if name == "telegram":
        mode = cfg.platforms.telegram.mode
        if cfg.platforms.telegram.home_chat is None:
            warnings.append("home_chat is not set: approval cards and reports have nowhere to go")
        return PlatformStatus(name, True, f"{mode} mode", warnings)
    if name == "slack":
        if not cfg.platforms.slack.home_channel:
            warnings.append("home_channel is not set: approval cards and reports have nowhere to go")
        transport = "Socket Mode" if cfg.platforms.slack.app_token else "HTTP events"
        return PlatformStatus(name, True, transport, warnings)
    if cfg.platforms.discord.home_channel is None:
        warnings.append("home_channel is not set: approval cards and reports have nowhere to go")
    return PlatformStatus(name, True, "gateway", warnings)
