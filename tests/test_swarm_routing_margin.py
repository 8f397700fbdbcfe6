"""Issue 32: semantic routing on a margin over the runner-up (0.045), refusing ambiguous tasks instead of guessing.

The old rule took the best worker whenever its cosine similarity cleared an absolute floor (0.3): a task that two
workers fit equally well went to whichever happened to score a hair higher. The embeddings come from the
wire-level fake, which embeds by concepts so the similarities are known.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kazma.engine.swarm.routing import EmbeddingRouter
from kazma.engine.swarm.types import TaskStatus
from tests.fakes.openai import FakeOpenAI
from tests.swarm_rig import config, failures, rig
from tests.swarm_support import ScriptedWorker

CFG = """
agents:
  workers:
    poet: {system_prompt: "p", expertise: [poetry]}
    coder: {system_prompt: "c", expertise: [code]}
pipelines: {}
"""
_POETRY = ("poetry", "verse", "poem", "sea")
_CODE = ("code", "program", "script", "bug")


def concepts(text: str) -> list[float]:
    """How much a text is about poetry, about code, or neither."""
    words = text.lower().replace(",", " ").replace(":", " ").split()
    return [float(sum(w in _POETRY for w in words)), float(sum(w in _CODE for w in words)), 0.3]


def workers() -> dict[str, ScriptedWorker]:
    return {
        "poet": ScriptedWorker("poet", expertise=("poetry",)),
        "coder": ScriptedWorker("coder", expertise=("code",)),
    }


async def test_a_clear_lead_routes_and_a_tie_is_refused_naming_both(tmp_path: Path) -> None:
    team = workers()
    async with FakeOpenAI(models=("embedder",)) as model:
        model.embed = concepts
        async with rig(tmp_path / "s.db", team, config(CFG)) as r:
            r.service.router = EmbeddingRouter(model.base_url, "embedder", deadline=5)
            record = await r.ended(await r.send("dispatch auto write a poem about the sea"))
            assert record.status is TaskStatus.SUCCEEDED
            assert record.request["routing"]["method"] == "semantic"
            assert record.request["routing"]["chosen"] == "poet"

            # a poem that is also a program: both similarities are high and equal — the old floor took one
            refused = await r.send("dispatch auto a poem that is a program")
            assert refused.startswith("Not started: the task fits ")
            assert "poet" in refused
            assert "coder" in refused
            assert "semantic routing needs a lead of 0.045 (swarm.routing_margin)" in refused
            assert "name the worker" in refused
            assert team["coder"].seen == []  # nothing ran for the tie
            assert len(team["poet"].seen) == 1


async def test_the_margin_is_the_configured_one(tmp_path: Path) -> None:
    async with FakeOpenAI(models=("embedder",)) as model:
        model.embed = concepts
        router = EmbeddingRouter(model.base_url, "embedder", margin=1.0, deadline=5)
        team = list(workers().values())
        with pytest.raises(LookupError, match=r"needs a lead of 1 \(swarm.routing_margin\)"):
            await router.route("write a poem about the sea", team)
        assert (
            await EmbeddingRouter(model.base_url, "embedder", deadline=5).route("fix this bug", team)
        ).worker.name == "coder"


async def test_a_failing_endpoint_is_counted_once_and_its_recovery_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kazma.swarm")
    before = failures("semantic_routing")
    async with FakeOpenAI(models=("embedder",)) as model:
        model.embed = concepts
        router = EmbeddingRouter(model.base_url, "embedder", deadline=5)
        team = list(workers().values())
        model.embeddings_error = 500
        for _ in range(3):
            assert (await router.route("fix the code", team)).method == "keyword_fallback"
        assert failures("semantic_routing") == before + 1
        model.embeddings_error = None
        assert (await router.route("fix this bug", team)).method == "semantic"
        model.embeddings_error = 500
        await router.route("fix the code", team)
        assert failures("semantic_routing") == before + 2  # a new spell after a recovery is counted again
    events = [(r.levelno, r.getMessage()) for r in caplog.records if r.getMessage().startswith("swarm.routing")]
    assert events == [
        (logging.WARNING, "swarm.routing_degraded"),
        (logging.INFO, "swarm.routing_still_degraded"),
        (logging.INFO, "swarm.routing_still_degraded"),
        (logging.INFO, "swarm.routing_recovered"),
        (logging.WARNING, "swarm.routing_degraded"),
    ]
