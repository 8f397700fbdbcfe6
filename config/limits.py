"""Limits that more than one layer holds to, each defined once here, at the bottom of the import graph.

A limit that one layer checks and a layer below it states (a configuration key's bound, a default) lives here,
so the two can never disagree.
"""

from __future__ import annotations

from typing import Final

KIB: Final = 1024
MIB: Final = 1024 * KIB

# Workers in one swarm task (and branches of a conditional); ``swarm.max_workers`` may lower it, never raise it.
MAX_WORKERS: Final = 32
# The most of one tool's output a model reads; an MCP server's ``max_output_chars`` defaults to it.
MAX_TOOL_OUTPUT_CHARS: Final = 16_000
# ``files:``: the bounds of what one message may carry, unless the configuration says otherwise.
DEFAULT_FILE_BYTES: Final = 10 * MIB
DEFAULT_FILE_COUNT: Final = 5
# ``approvals.remember.max_seconds`` at most: no remembered approval Kazma makes lasts longer after its approval.
MAX_REMEMBER_SECONDS: Final = 24 * 3600
