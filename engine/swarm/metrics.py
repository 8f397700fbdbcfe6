"""The swarm's own Prometheus series (failures by site live in :mod:`kazma.config.metrics`)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from kazma.config.metrics import FAILURES, SWARM_FAILURES

HANDOFFS = Counter("kazma_swarm_handoffs", "Handoffs between swarm workers, by outcome.", ["outcome"])
WORKER_CALLS = Counter("kazma_swarm_worker_calls", "Swarm worker calls, by worker and outcome.", ["worker", "outcome"])
WORKER_LATENCY = Histogram(
    "kazma_swarm_worker_latency_seconds",
    "How long one swarm worker call took (retries included).",
    ["worker"],
    buckets=(0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0),
)
WORKER_TOKENS = Counter("kazma_swarm_worker_tokens", "Model tokens used by swarm workers.", ["worker", "kind"])
ROUTING = Counter("kazma_swarm_routing", "How workers=auto picked its worker.", ["method"])

# The design's failure sites: every place a swarm task can fail without its own worker failing.
FAILURE_SITES = (
    "running_row",  # the task store could not admit the task: nothing started
    "finish_row",  # the result could not be stored
    "run",  # the task's own coroutine crashed
    "report",  # a progress line could not be sent
    "deliver",  # the result could not be posted to its route
    "synthesis",  # the synthesis call failed: the labelled answers were kept
    "refiner",  # the pipeline refiner failed: the unrefined result was kept
    "routing",  # semantic routing failed: keyword routing was used
    "breaker_row",  # a breaker's state could not be saved
    "metrics_row",  # a worker's daily numbers could not be saved
    "retention",  # the periodic retention sweep failed
)


def swarm_failure(site: str) -> None:
    """Count one failure at ``site`` in ``kazma_swarm_failures_total{site}`` (and the process-wide counter)."""
    SWARM_FAILURES.labels(site=site).inc()
    FAILURES.labels(site=f"swarm_{site}", platform="").inc()
