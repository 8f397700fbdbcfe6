"""Process-wide counters for every failure site that loses evidence or a decision.

The names are stable: dashboards and alerts depend on them. Every layer may
count here because this module sits at the bottom of the import graph.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter

FAILURES = Counter(
    "kazma_failures",
    "Failures that lost or delayed evidence or a decision, by site and platform.",
    ["site", "platform"],
)


def count_failure(site: str, platform: str = "") -> None:
    FAILURES.labels(site=site, platform=platform).inc()


def failure_count(site: str, platform: str = "") -> float:
    """Current value of one failure counter (for ``kazma doctor`` and tests)."""
    value = REGISTRY.get_sample_value("kazma_failures_total", {"site": site, "platform": platform})
    return value or 0.0
