"""The installed distribution's version, looked up when first asked for.

The lookup scans every distribution on the path (tens of milliseconds at each
start); only ``kazma --version`` and the ``http_get`` tool's User-Agent need it.
"""

from __future__ import annotations

import functools


@functools.cache
def kazma_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kazma")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return "0.0.0+unknown"


def __getattr__(name: str) -> str:
    if name == "__version__":
        return kazma_version()
    raise AttributeError(f"module 'kazma.config.version' has no attribute {name!r}")
