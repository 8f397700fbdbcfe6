"""``workers=auto``: semantic routing by embeddings, with keyword routing as the counted fallback.

The task and each worker's profile (name and expertise) are embedded in one
request to the configured OpenAI-compatible endpoint (``model.embeddings``);
the worker whose profile is most similar wins when it clears the match floor.
An endpoint that fails or misses its deadline, or a best match under the floor,
falls back to keyword routing and is counted, so a task phrased in other words
or another language still finds its worker when embeddings are on.
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
        floor: float = 0.3,
        deadline: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = f"{base_url.rstrip('/')}/embeddings"
        self.model = model
        self.api_key = api_key
        self.floor = floor
        self.deadline = deadline
        self._transport = transport

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
        """The best worker for ``task``; raises :class:`NoCapableWorker` only when keywords find nobody either."""
        try:
            async with asyncio.timeout(self.deadline):
                vectors = await self._embed([task, *(profile(w) for w in workers)])
        except Exception as exc:  # any failure of the endpoint: keywords still route
            swarm_failure("routing")
            log.warning("swarm.routing_fallback", error=f"{type(exc).__name__}: {exc}")
            return self._keywords(task, workers, [], f"embeddings failed: {type(exc).__name__}")
        scores = sorted(
            ((w.name, cosine(vectors[0], v)) for w, v in zip(workers, vectors[1:], strict=True)),
            key=lambda item: -item[1],
        )
        name, best = scores[0] if scores else ("", 0.0)
        if best >= self.floor:
            ROUTING.labels(method="semantic").inc()
            chosen = next(w for w in workers if w.name == name)
            return RouteChoice(chosen, "semantic", scores)
        return self._keywords(task, workers, scores, f"best match {best:.2f} is under the floor {self.floor:.2f}")

    def _keywords(self, task: str, workers: Sequence[Worker], scores: list[tuple[str, float]], why: str) -> RouteChoice:
        ROUTING.labels(method="keyword_fallback").inc()
        try:
            chosen = route_auto(task, workers)
        except NoCapableWorker as exc:
            raise NoCapableWorker(f"{exc}; semantic routing: {why}") from None
        return RouteChoice(chosen, "keyword_fallback", scores, why)
