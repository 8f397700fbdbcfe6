"""``kazma.config``: the ``kazma.yaml`` models, loading and validation; the storage layer is ``kazma.config.store``.

The names below are imported on first use (PEP 562): ``kazma --version`` reads
``kazma.config.version`` without paying for pydantic and the models.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kazma.config.errors import ConfigError, Problem
    from kazma.config.loader import LoadedConfig, load_config, load_config_text
    from kazma.config.models import DangerLevel, KazmaConfig
    from kazma.config.platforms import PlatformStatus, enabled_platforms, platform_statuses
    from kazma.config.version import __version__

_HOME = {
    "ConfigError": "errors",
    "Problem": "errors",
    "LoadedConfig": "loader",
    "load_config": "loader",
    "load_config_text": "loader",
    "DangerLevel": "models",
    "KazmaConfig": "models",
    "PlatformStatus": "platforms",
    "enabled_platforms": "platforms",
    "platform_statuses": "platforms",
    "__version__": "version",
}

__all__ = [
    "ConfigError",
    "DangerLevel",
    "KazmaConfig",
    "LoadedConfig",
    "PlatformStatus",
    "Problem",
    "__version__",
    "enabled_platforms",
    "load_config",
    "load_config_text",
    "platform_statuses",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'kazma.config' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kazma.config.{home}"), name)
    globals()[name] = value
    return value
