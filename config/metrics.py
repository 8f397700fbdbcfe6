"""Process-wide counters for every failure site that loses evidence or a decision.

The names are stable: dashboards and alerts depend on them. Every layer may
count here because this module sits at the bottom of the import graph.
"""

from __future__ import annotations

import math
import time

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

FAILURES = Counter(
    "kazma_failures",
    "Failures that lost or delayed evidence or a decision, by site and platform.",
    ["site", "platform"],
)


SWARM_FAILURES = Counter("kazma_swarm_failures", "Failures in the swarm engine, by site.", ["site"])

APPROVALS_OPENED = Counter("kazma_approvals_opened", "Approval requests opened, by tool.", ["tool"])
APPROVALS_DECIDED = Counter(
    "kazma_approvals_decided",
    "Approval requests that reached an outcome, by outcome, platform and the person under people: who decided "
    "(empty: nobody's identity, or no person decided: a timeout, a cancellation).",
    ["outcome", "platform", "person"],
)
APPROVALS_REVIEWED = Counter(
    "kazma_approvals_reviewed",
    "Reviews counted under a policy of several people that did not decide their request, by decision and platform.",
    ["decision", "platform"],
)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PRESS_TO_DECISION = Histogram(
    "kazma_press_to_decision_seconds",
    "From a press reaching Kazma to its decision being stored.",
    buckets=_LATENCY_BUCKETS,
)
DECISION_TO_SETTLED = Histogram(
    "kazma_decision_to_settled_seconds",
    "From a request's outcome to the last of its cards showing it.",
    buckets=_LATENCY_BUCKETS,
)


AUDIT_SIGNED_SEQ = Gauge(
    "kazma_audit_last_signed_seq", "The sequence number of the audit event the newest signed checkpoint covers."
)
AUDIT_CHECKPOINT_AGE = Gauge(
    "kazma_audit_checkpoint_age_seconds",
    "Seconds since the newest signed checkpoint of the audit chain was made (NaN: none seen yet).",
)
_newest_checkpoint_at: list[float] = []
AUDIT_CHECKPOINT_AGE.set_function(lambda: time.time() - _newest_checkpoint_at[0] if _newest_checkpoint_at else math.nan)


def audit_checkpoint_seen(seq: int, at: float) -> None:
    """The newest signed checkpoint of the audit chain, as this process last saw it."""
    AUDIT_SIGNED_SEQ.set(seq)
    _newest_checkpoint_at[:] = [at]


# Each counter's child per label values, looked up once: ``labels()`` checks and joins its values and takes the
# metric's lock on every call (~3 µs of a press). The children are never removed, so a cached one stays the one
# exported.
_children: dict[tuple[object, ...], Counter] = {}


def _child(metric: Counter, *values: str) -> Counter:
    key = (metric, *values)
    found = _children.get(key)
    if found is None:
        found = _children[key] = metric.labels(*values)
    return found


def count_decided(outcome: str, platform: str, person: str) -> None:
    _child(APPROVALS_DECIDED, outcome, platform, person).inc()


def count_reviewed(decision: str, platform: str) -> None:
    _child(APPROVALS_REVIEWED, decision, platform).inc()


def count_failure(site: str, platform: str = "") -> None:
    _child(FAILURES, site, platform).inc()
    if site.startswith("swarm"):
        _child(SWARM_FAILURES, site).inc()


def failure_count(site: str, platform: str = "") -> float:
    """Current value of one failure counter (for ``kazma doctor`` and tests)."""
    value = REGISTRY.get_sample_value("kazma_failures_total", {"site": site, "platform": platform})
    return value or 0.0


def with_label(exposition: bytes, name: str, value: str) -> bytes:
    """Every sample of a Prometheus text exposition with one more label (``replica="b"``): several replicas
    serve the same series names, and a scrape through a load balancer must still say whose each one is."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    pair = f'{name}="{escaped}"'
    out: list[str] = []
    for line in exposition.decode().splitlines():
        brace, space = line.find("{"), line.find(" ")
        if not line or line.startswith("#") or space < 0:
            out.append(line)
        elif 0 <= brace < space:  # name{labels} value: the first label may hold spaces, the name cannot
            out.append(f"{line[: brace + 1]}{pair},{line[brace + 1 :]}")
        else:
            out.append(f"{line[:space]}{{{pair}}}{line[space:]}")
    return ("\n".join(out) + "\n").encode()
