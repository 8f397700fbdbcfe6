"""Each swarm task's workers have a history and a workspace of their own.

Every task's workers ran in one conversation, "swarm": a worker's second task read its first task's prompt and
answer (any chat's, anyone's) as its own history, and the two shared a workspace.
"""

from __future__ import annotations

from pathlib import Path

from kazma.engine.agent import workspace_for
from kazma.engine.swarm.types import TaskStatus, task_conversation, working_for
from tests.agent_swarm import agent_workers, requests_of, say
from tests.swarm_rig import config, rig

CFG = """
agents:
  workers:
    a: {system_prompt: "You are a."}
pipelines: {}
swarm: {retries: 0}
"""


async def test_a_workers_second_task_does_not_read_its_first_tasks_prompt_or_answer(tmp_path: Path) -> None:
    cfg = config(CFG)
    async with agent_workers(tmp_path, ["a"], cfg) as agents:
        agents.model.script_agent("You are a.", say("the launch codes are 0000"), say("done"))
        async with rig(tmp_path / "swarm.db", agents.workers, cfg) as r:
            first = await r.ended(await r.send("dispatch a keep the launch codes of team red"))
            second = await r.ended(await r.send("dispatch a write a haiku"))
        assert (first.status, second.status) == (TaskStatus.SUCCEEDED, TaskStatus.SUCCEEDED)
        asked = requests_of(agents.model, "a")
        assert len(asked) == 2
        seen = " ".join(str(m["content"]) for m in asked[1].body["messages"])
        assert "write a haiku" in seen
        assert "team red" not in seen
        assert "0000" not in seen


def test_a_tasks_conversation_is_its_own_and_never_a_chat() -> None:
    root = Path("/workspaces")
    assert task_conversation("swarm") == "swarm"  # outside a task: as before
    with working_for("telegram:1", "Ab3_x-9"):
        mine = task_conversation("swarm")
    with working_for("telegram:1", "Zz9"):
        other = task_conversation("swarm")
    assert mine != other
    assert ":" not in mine  # no address: nothing is remembered or told in it
    assert workspace_for(root, mine) != workspace_for(root, other) != workspace_for(root, "swarm")


async def test_a_retried_task_works_in_the_conversation_of_the_task_it_runs_again(tmp_path: Path) -> None:
    # Its workspace (what the first attempt left) and the note on a card of a call that may have run are that
    # line's: a retry in a conversation of its own lost both.
    cfg = config(CFG)
    async with agent_workers(tmp_path, ["a"], cfg) as agents:
        agents.model.script_agent("You are a.", say("first answer"), say("second answer"), say("third answer"))
        async with rig(tmp_path / "swarm.db", agents.workers, cfg) as r:
            first = await r.ended(await r.send("dispatch a count the sheep"))
            answer = await r.send(f"retry {first.id}")
            again = await r.ended(f"swarm task {answer.split()[-1]}")
            third = await r.ended(await r.send(f"retry {again.id}"))  # a retry of a retry: still the first's line
            other = await r.ended(await r.send("dispatch a something else"))
        assert again.id != first.id
        assert again.request["lineage"] == third.request["lineage"] == first.id
        asked = requests_of(agents.model, "a")
        assert len(asked) == 4
        seen = [" ".join(str(m["content"]) for m in request.body["messages"]) for request in asked]
        assert "first answer" in seen[1]  # the retry's worker has the first attempt's exchange
        assert "second answer" in seen[2]
        assert "sheep" not in seen[3]  # another task: none of that line's
        assert other.request["lineage"] is None
