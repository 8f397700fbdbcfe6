"""``workers=auto``: semantic routing by embeddings, with keyword routing as the counted fallback.

The task and each worker's profile (name and expertise) are embedded in one
request to the configured OpenAI-compatible endpoint (``model.embeddings``).
The most similar worker wins only when it leads the runner-up by the margin
(``swarm.routing_margin``, 0.045 by default; a lone worker must lead
:data:`ALONE`): a task that two workers fit about equally well is refused,
naming both, instead of being guessed. An absolute similarity floor could not
do that — scores shift with the embedding model, while a lead over the
runner-up does not.

An endpoint that fails or misses its deadline hands the task to keyword
routing; the switch is counted once (``semantic_routing``) and logged at
WARNING, its recovery at INFO.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import structlog

from kazma.engine.swarm.metrics import ROUTING, swarm_failure
from kazma.engine.swarm.patterns import NoCapableWorker, route_auto
from kazma.engine.swarm.types import Worker

log = structlog.get_logger("kazma.swarm")


# What a lone worker's similarity is measured against: a typical similarity of unrelated texts.
ALONE = 0.40


class AmbiguousTask(NoCapableWorker):
    """Semantic routing could not tell which worker the task is for: refused, never guessed."""


@dataclass(frozen=True)
class RouteChoice:
    worker: Worker
    method: str  # "semantic", "keyword" (no embeddings configured) or "keyword_fallback"
    candidates: list[tuple[str, float]] = field(default_factory=list)  # (worker, similarity), best first
    reason: str = ""

    def as_json(self) -> dict[str, object]:
        return {
            "method": self.method,
            "chosen": self.worker.name,
            "candidates": [[name, round(score, 4)] for name, score in self.candidates],
            "reason": self.reason,
        }


def profile(worker: Worker) -> str:
    return f"{worker.name}: {', '.join(worker.expertise)}" if worker.expertise else worker.name


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=False))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


class EmbeddingRouter:
    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str = "",
        margin: float = 0.045,
        deadline: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = f"{base_url.rstrip('/')}/embeddings"
        self.model = model
        self.api_key = api_key
        self.margin = margin
        self.deadline = deadline
        self._transport = transport
        self._degraded = False  # keywords route while the endpoint fails: counted once, when it starts

    async def _embed(self, texts: Sequence[str]) -> list[list[float]]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(timeout=self.deadline, transport=self._transport) as client:
            reply = await client.post(self.url, json={"model": self.model, "input": list(texts)}, headers=headers)
            reply.raise_for_status()
            data = reply.json()["data"]
        vectors = [list(map(float, item["embedding"])) for item in sorted(data, key=lambda d: int(d["index"]))]
        if len(vectors) != len(texts):
            raise ValueError(f"{len(vectors)} embeddings for {len(texts)} texts")
        return vectors

    async def route(self, task: str, workers: Sequence[Worker]) -> RouteChoice:
        """The worker ``task`` is for; raises :class:`AmbiguousTask` when the embeddings cannot tell, and
        :class:`NoCapableWorker` when the endpoint failed and keywords find nobody either."""
        try:
            async with asyncio.timeout(self.deadline):
                vectors = await self._embed([task, *(profile(w) for w in workers)])
        except Exception as exc:  # any failure of the endpoint: keywords still route
            why = f"{type(exc).__name__}: {exc}"
            if not self._degraded:
                self._degraded = True
                swarm_failure("semantic_routing")
                log.warning("swarm.routing_degraded", error=why)
            else:
                log.info("swarm.routing_still_degraded", error=why)
            return self._keywords(task, workers, [], f"embeddings failed: {type(exc).__name__}")
        if self._degraded:
            self._degraded = False
            log.info("swarm.routing_recovered")
        scores = sorted(
            ((w.name, cosine(vectors[0], v)) for w, v in zip(workers, vectors[1:], strict=True)),
            key=lambda item: -item[1],
        )
        if not scores:
            raise NoCapableWorker("there are no workers to route to")
        name, best = scores[0]
        runner, second = scores[1] if len(scores) > 1 else ("", ALONE)
        if best - second >= self.margin:
            ROUTING.labels(method="semantic").inc()
            chosen = next(w for w in workers if w.name == name)
            return RouteChoice(chosen, "semantic", scores)
        ROUTING.labels(method="ambiguous").inc()
        log.info("swarm.routing_ambiguous", best=name, score=round(best, 4), runner_up=runner, second=round(second, 4))
        if runner:
            raise AmbiguousTask(
                f"the task fits {name} ({best:.3f}) and {runner} ({second:.3f}) about equally: the best leads by "
                f"{best - second:.3f}, and semantic routing needs a lead of {self.margin:g} "
                f"(swarm.routing_margin); name the worker, e.g. /swarm dispatch {name} …"
            )
        raise AmbiguousTask(
            f"the task is not clearly for {name} (similarity {best:.3f}, needs {ALONE + self.margin:.3f}); "
            f"name the worker, e.g. /swarm dispatch {name} …"
        )

    def _keywords(self, task: str, workers: Sequence[Worker], scores: list[tuple[str, float]], why: str) -> RouteChoice:
        ROUTING.labels(method="keyword_fallback").inc()
        try:
            chosen = route_auto(task, workers)
        except NoCapableWorker as exc:
            raise NoCapableWorker(f"{exc}; semantic routing: {why}") from None
        return RouteChoice(chosen, "keyword_fallback", scores, why)
