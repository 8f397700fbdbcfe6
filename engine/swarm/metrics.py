"""The swarm's own Prometheus series, and its failure sites: the one list, read by the code, the README and the tests.

``kazma_swarm_failures_total{site}`` counts every place where the swarm lost
evidence or a decision, or fell back to a degraded result. The sites carry the
names of the swarm design (its §9 and §1.0f); :data:`DESIGN_SITES_NOT_HERE`
says why a few of the design's sites have nothing to count in Kazma.
"""

from __future__ import annotations

from collections.abc import Mapping

import structlog
from prometheus_client import Counter, Histogram

from kazma.config.metrics import FAILURES, SWARM_FAILURES

log = structlog.get_logger("kazma.swarm")

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

FAILURE_SITES: Mapping[str, str] = {
    # lost evidence or a decision (the design's names)
    "running_row": "a task's RUNNING row (admission, or a resume after its checkpoint was approved) was not written: "
    "nothing ran",
    "task_write": "a task's ending could not be stored: the row stays as last stored and the next start calls it "
    "interrupted",
    "step_journal": "a step's journal entry, record or current-step mark was not written: the run went on",
    "worker_metric": "a worker's numbers for the day were not saved",
    "orphan_evidence": "a refused (stale) write could not be kept as evidence: it is in the log only",
    "recovery_read": "the tasks to recover could not be read at start: they wait for the next start",
    "gate_register": "a pipeline checkpoint's approval could not be opened: the task ended failed",
    "gate_settle": "a checkpoint's approval could not be withdrawn after its task ended: its cards stay until the "
    "request's deadline",
    "approval_resolve": "a checkpoint decision could not be recorded: the checkpoint stays pending",
    "breaker_read": "the saved breakers could not be read at start: every breaker starts closed",
    "breaker_persist": "a breaker's state could not be saved: it still works in memory",
    # degraded results (the design's names)
    "refiner": "the pipeline refiner failed: the unrefined result was kept",
    "synthesis": "a synthesis or choice by the model failed: the deterministic fallback was used",
    "semantic_routing": "the embeddings endpoint failed: keywords route until it answers again (counted once)",
    # Kazma's own
    "run": "a task's own coroutine crashed: it was stored failed",
    "report": "a progress line could not be sent",
    "deliver": "a task's result could not be posted to its route",
    "retention": "the periodic retention sweep failed",
    "retry_ask": "a /swarm retry's ask could not be kept or read: nothing ran, the person was told to send again",
}

# The design's sites Kazma has nothing to count at, and why (the README's swarm section says the same).
DESIGN_SITES_NOT_HERE: Mapping[str, str] = {
    "reap": "Kazma has no autoscaled worker pool: workers are the ones in kazma.yaml",
    "idle_reap": "no autoscaled pool, so no idle instances to reap",
    "checkpoint_timeout_arm": "a checkpoint's deadline is its approval request's own deadline, stored in the "
    "request's row; there is no timer to arm",
    "breaker_lease": "breakers are per process (saved for its restart), not shared between replicas",
    "durable_workflow": "Kazma runs no Temporal workflows: the task store is the record",
}


def swarm_failure(site: str) -> None:
    """Count one failure at ``site`` in ``kazma_swarm_failures_total{site}`` (and the process-wide counter)."""
    if site not in FAILURE_SITES:  # a guard test keeps calls to listed sites; never fail a failure path over it
        log.error("swarm.unknown_failure_site", site=site)
    SWARM_FAILURES.labels(site=site).inc()
    FAILURES.labels(site=f"swarm_{site}", platform="").inc()
