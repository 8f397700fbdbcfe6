"""``kazma.config``: the ``kazma.yaml`` models, loading and validation, and the store bootstrap."""

from kazma.config.errors import ConfigError, Problem
from kazma.config.loader import LoadedConfig, load_config, load_config_text
from kazma.config.models import DangerLevel, KazmaConfig
from kazma.config.platforms import PlatformStatus, enabled_platforms, platform_statuses
from kazma.config.version import __version__

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
