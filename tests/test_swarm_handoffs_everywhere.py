"""Issue 32: ``handoff_to_worker`` in every pattern, not only ``dispatch`` (the swarm design's §4).

Each pattern runs real agent workers against the wire-level fake model. Worker ``a`` is offered the tool,
hands its part to ``c``, and ``c``'s answer takes ``a``'s place: the stage, the parallel answer, the
branch. ``c`` reads what ``a`` passed on fenced as data, and the task keeps the chain.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kazma.engine.swarm.types import TaskStatus
from kazma.engine.swarm.workers import HANDOFF_TOOL
from tests.agent_swarm import agent_workers, handoff, offered_tools, requests_of, say, user_text
from tests.swarm_rig import config, rig

CFG = """
agents:
  workers:
    a: {system_prompt: "You are a."}
    b: {system_prompt: "You are b."}
    c: {system_prompt: "You are c."}
    router: {system_prompt: "You are router."}
pipelines: {}
swarm: {retries: 0}
"""

# pattern: (command, what the task's result says, scripted answers of b, c and router besides a's handoff)
PATTERNS = {
    "dispatch": ("dispatch a do the job", "c did it", {"c": 1}),
    "pipeline": ("pipeline a,b do the job", "b built on it", {"b": 1, "c": 1}),
    "fanout": ("fanout a,b --strategy merge_all do the job", "[c] c did it\n\n[b] b answered", {"b": 1, "c": 1}),
    "consult": ("consult a,b do the job", "[c] c did it\n\n[b] b answered", {"b": 1, "c": 1}),
    "broadcast": ("broadcast do the job", "[c] c did it", {"b": 1, "c": 2, "router": 1}),
    "conditional": ("conditional router alpha=a,beta=b do the job", "c did it", {"c": 1, "router": 1}),
}
ANSWERS = {"b": "b answered", "c": "c did it", "router": "alpha"}


@pytest.mark.parametrize("pattern", list(PATTERNS))
async def test_every_pattern_offers_and_follows_a_handoff(tmp_path: Path, pattern: str) -> None:
    command, result, others = PATTERNS[pattern]
    cfg = config(CFG)
    async with agent_workers(tmp_path, ["a", "b", "c", "router"], cfg) as agents:
        model = agents.model
        model.script_agent("You are a.", handoff("c", "c knows this"), say("over to c"))
        for name, count in others.items():
            answer = "b built on it" if pattern == "pipeline" and name == "b" else ANSWERS[name]
            model.script_agent(f"You are {name}.", *[say(answer) for _ in range(count)])
        async with rig(tmp_path / "swarm.db", agents.workers, cfg) as r:
            record = await r.ended(await r.send(command))

        assert record.status in (TaskStatus.SUCCEEDED, TaskStatus.PARTIAL), record.error
        assert record.result is not None
        assert result in record.result["output"]
        first_of_a = requests_of(model, "a")[0]
        assert HANDOFF_TOOL in offered_tools(first_of_a)
        chain = record.result["details"]["handoffs"]
        assert [(h["from"], h["to"]) for h in chain] == [("a", "c")]
        assert chain[0]["reason"] == "c knows this"
        to_c = [user_text(req) for req in requests_of(model, "c") if "handing over" in user_text(req)]
        assert len(to_c) == 1
        assert "Untrusted data from a, handing over" in to_c[0]
        assert "notes for c" in to_c[0]
        # the run that handed over still counts: a's two calls, then everyone else's one each
        calls = sum(len(requests_of(model, n)) for n in ("a", "b", "c", "router"))
        assert record.result["tokens"]["prompt"] == 10 + 3 + (calls - 2) * 3
        if pattern == "pipeline":
            # the next stage reads the answer that ended stage 1's chain (c's), fenced
            (to_b,) = [user_text(req) for req in requests_of(model, "b")]
            assert "Untrusted data from stage 1 (c)" in to_b
            assert "c did it" in to_b


async def test_the_conditional_router_only_names_a_branch(tmp_path: Path) -> None:
    cfg = config(CFG)
    async with agent_workers(tmp_path, ["a", "b", "c", "router"], cfg) as agents:
        agents.model.script_agent("You are router.", say("beta"))
        agents.model.script_agent("You are b.", say("b answered"))
        async with rig(tmp_path / "swarm.db", agents.workers, cfg) as r:
            record = await r.ended(await r.send("conditional router alpha=a,beta=b do the job"))
        assert record.status is TaskStatus.SUCCEEDED
        (to_router,) = requests_of(agents.model, "router")
        assert HANDOFF_TOOL not in offered_tools(to_router)
        (to_b,) = requests_of(agents.model, "b")
        assert HANDOFF_TOOL in offered_tools(to_b)
