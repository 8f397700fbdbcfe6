"""Names in swarm commands — workers, pipeline presets, conditional branches — mean the same on every surface: /swarm
in chat, `kazma swarm`, and the lead's dispatch_swarm. Presets used to match only in the configured case while
worker names matched in any; the lead's tool took worker names in their exact case only, and took branches that
differ only in case (or hold characters a router's answer can never name) as separate, unreachable branches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kazma.approvals import SafetyPolicy
from kazma.bot.cli.context import Context
from kazma.bot.cli.swarm_cli import swarm
from kazma.config import ConfigError, load_config_text
from kazma.engine.agent import AgentSpec, TurnContext
from kazma.engine.swarm.builtin_patterns import PipelineCommand
from kazma.engine.swarm.grammar import parse
from kazma.engine.swarm.lead_tools import swarm_tools
from kazma.engine.swarm.syntax import GrammarError
from kazma.engine.swarm.types import TaskStatus, WorkerResult
from tests.approvals_support import approval_service
from tests.swarm_rig import config, rig
from tests.swarm_support import ScriptedWorker

CFG = """
agents:
  workers:
    a: {system_prompt: "You are a."}
    b: {system_prompt: "You are b."}
pipelines: {Both: [a, b]}
tools: {dispatch_swarm: read}
"""
WORKERS = ("a", "b")
LEAD = TurnContext("telegram:-1001", AgentSpec("kazma", "lead", is_lead=True), "telegram:111")


@pytest.mark.parametrize("written", ["Both", "both", "BOTH"])
def test_the_grammar_takes_a_preset_in_any_case_and_records_the_configured_name(written: str) -> None:
    command = parse(f"pipeline {written} go", workers=WORKERS, pipelines={"Both": ["a", "b"]})
    assert command == PipelineCommand(("a", "b"), "go", preset="Both")


def test_the_cli_takes_a_preset_in_any_case(tmp_path: Path) -> None:
    path = tmp_path / "kazma.yaml"
    path.write_text(CFG)
    result = CliRunner().invoke(
        swarm, ["--parse-only", "pipeline", "bOtH", "go"], obj=Context(path), catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["preset"] == "Both"


def test_a_config_refuses_two_presets_that_differ_only_in_case() -> None:
    with pytest.raises(ConfigError, match=r"pipelines\.both.*'Both' and 'both' differ only in case"):
        load_config_text(CFG.replace("{Both: [a, b]}", "{Both: [a, b], both: [b]}"))


async def test_the_leads_tool_takes_names_in_any_case_as_slash_swarm_does(tmp_path: Path) -> None:
    cfg = config(CFG)
    async with (
        rig(tmp_path / "s.db", {"a": ScriptedWorker("a"), "b": ScriptedWorker("b")}, cfg) as r,
        approval_service(tmp_path / "ap.db", config=cfg) as approvals,
    ):
        dispatch, _ = swarm_tools(r.service, SafetyPolicy(approvals))
        by_preset = await dispatch.handler({"pattern": "pipeline", "task": "go", "preset": "BOTH"}, LEAD)
        assert by_preset.ok, by_preset.error
        by_workers = await dispatch.handler({"pattern": "fan_out", "task": "go", "workers": ["A", "b"]}, LEAD)
        assert by_workers.ok, by_workers.error
        twice = await dispatch.handler({"pattern": "fan_out", "task": "go", "workers": ["A", "a"]}, LEAD)
        assert not twice.ok
        assert "worker(s) listed twice: a" in (twice.error or "")
        records = {record.pattern: await r.service.wait(record.id, 30) for record in await r.service.store.list()}
    pipeline, fan_out = records["pipeline"], records["fan_out"]
    assert pipeline is not None
    assert pipeline.status is TaskStatus.SUCCEEDED, pipeline
    assert pipeline.request["preset"] == "Both"
    assert fan_out is not None
    assert fan_out.status is TaskStatus.SUCCEEDED, fan_out
    assert fan_out.request["workers"] == ["a", "b"]


def test_the_grammar_refuses_branches_that_differ_only_in_case() -> None:
    with pytest.raises(GrammarError, match="branch 'yes' is listed twice"):
        parse("conditional a Yes=a,yes=b go", workers=WORKERS, pipelines={})


async def test_the_leads_tool_treats_branches_as_slash_swarm_does(tmp_path: Path) -> None:
    cfg = config(CFG)
    async with (
        rig(tmp_path / "s.db", {"a": ScriptedWorker("a"), "b": ScriptedWorker("b")}, cfg) as r,
        approval_service(tmp_path / "ap.db", config=cfg) as approvals,
    ):
        dispatch, _ = swarm_tools(r.service, SafetyPolicy(approvals))
        conditional = {"pattern": "conditional", "task": "go", "workers": ["a"]}
        twice = await dispatch.handler({**conditional, "routes": {"Yes": "a", "yes": "b"}}, LEAD)
        assert not twice.ok
        assert "branch 'yes' is listed twice" in (twice.error or "")
        spaced = await dispatch.handler({**conditional, "routes": {"yes please": "a"}}, LEAD)
        assert not spaced.ok
        assert "branch 'yes please'" in (spaced.error or "")
        assert await r.service.store.list() == []


async def test_a_branch_in_another_case_or_with_a_dash_is_reachable(tmp_path: Path) -> None:
    """The router's answer was read as words of letters and digits only, lowered: a branch the lead named "Yes",
    or any branch with '-' or '_' (which /swarm takes), could never be chosen, and the task failed."""
    router = ScriptedWorker("a", [WorkerResult("a", True, output="needs-review"), WorkerResult("a", True, "Yes")])
    b = ScriptedWorker("b")
    cfg = config(CFG)
    async with (
        rig(tmp_path / "s.db", {"a": router, "b": b}, cfg) as r,
        approval_service(tmp_path / "ap.db", config=cfg) as approvals,
    ):
        dashed = await r.ended(await r.send("conditional a needs-review=b,ok=a check this"))
        assert dashed.status is TaskStatus.SUCCEEDED, dashed
        dispatch, _ = swarm_tools(r.service, SafetyPolicy(approvals))
        started = await dispatch.handler(
            {"pattern": "conditional", "task": "go", "workers": ["A"], "routes": {"Yes": "B", "no": "a"}}, LEAD
        )
        assert started.ok, started.error
        (record,) = [t for t in await r.service.store.list() if t.id != dashed.id]
        cased = await r.service.wait(record.id, 30)
    assert cased is not None
    assert cased.status is TaskStatus.SUCCEEDED, cased
    assert cased.request["routes"] == [["yes", "b"], ["no", "a"]]
    assert [prompt for prompt, _ in b.seen] == ["check this", "go"]


async def test_the_leads_tool_refuses_arguments_its_task_would_run_without(tmp_path: Path) -> None:
    """A preset beside workers ran the preset alone, a conditional's second worker never ran, routes given to
    another pattern did nothing: each started a task and told the lead it ran what it named."""
    cfg = config(CFG)
    async with (
        rig(tmp_path / "s.db", {"a": ScriptedWorker("a"), "b": ScriptedWorker("b")}, cfg) as r,
        approval_service(tmp_path / "ap.db", config=cfg) as approvals,
    ):
        dispatch, _ = swarm_tools(r.service, SafetyPolicy(approvals))
        refused: list[tuple[dict[str, Any], str]] = [
            (
                {"pattern": "pipeline", "preset": "both", "workers": ["b"]},
                "give a pipeline preset or workers, not both",
            ),
            ({"pattern": "conditional", "workers": ["a", "b"], "routes": {"x": "a"}}, "one router worker, 2 given"),
            ({"pattern": "fan_out", "workers": ["a", "b"], "routes": {"x": "a"}}, "fan_out would not use them"),
        ]
        for arguments, expected in refused:
            result = await dispatch.handler({**arguments, "task": "go"}, LEAD)
            assert not result.ok
            assert expected in (result.error or "")
        assert await r.service.store.list() == []
