"""Libraries imported without the optional extras they load whenever those are installed.

structlog's package imports its Twisted integration when ``twisted`` can be
imported, its console renderer imports ``rich`` for tracebacks, and its
deprecated ``threadlocal`` module imports ``greenlet``; httpx imports its
command line (``rich``, ``pygments``) when they can be imported.
Kazma uses none of it, and no runtime dependency installs it, yet the dev
extra does (matrix-synapse for the Matrix tests brings Twisted, import-linter
brings rich, Playwright greenlet): with it, an idle `kazma run` held about 7 MB more (bench/idle_rss.py;
greenlet 1.2 MB of it) and spent a tenth of its imports on them, and console-log tracebacks looked different on a
developer's machine than in production. Hidden while these two are first
imported, the extras stay importable for anything else that asks for them.

:func:`without` does the same for a platform library: python-telegram-bot
imports its webhook server (Tornado, 2 to 4 MB) whenever it is installed,
which long polling never uses (config/registry: ``unused_imports``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_EXTRAS = ("twisted", "rich", "pygments", "better_exceptions", "greenlet")
_LIBRARIES = ("structlog", "httpx")


@contextmanager
def without(names: tuple[str, ...]) -> Iterator[None]:
    """While inside, importing any of ``names`` (not imported yet) raises ImportError; afterwards they import."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # an import of it raises ImportError
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def _import_without_extras() -> None:
    first = [name for name in _LIBRARIES if name not in sys.modules]  # one imported already stays as it is
    with without(_EXTRAS if first else ()):
        for name in first:
            importlib.import_module(name)


_import_without_extras()

import structlog  # noqa: E402 - after the import above, which decided what structlog loaded

__all__ = ["structlog"]
