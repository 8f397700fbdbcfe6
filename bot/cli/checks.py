"""One line of ``kazma doctor``: what was checked, how it went, and what to do about it.

Defined beside the platforms' own doctor checks (:mod:`kazma.adapters.platform_cli`), which write the same lines.
"""

from __future__ import annotations

from kazma.adapters.platform_cli import Check, Level

__all__ = ["Check", "Level"]
