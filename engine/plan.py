"""Plans: what the lead agent writes (intent) and what the executor tracks (run state).

The model owns ``PlanSpec``; only the executor writes a step's status,
summary, files and failure reason (invariant 9).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from kazma.engine.fence import fence_untrusted
from kazma.engine.tools.executions import ExecutionSummary
from kazma.engine.types import ToolUse, Usage, tools_line

USER = "user"
_REFERENCE = re.compile(r"\{\{\s*step_(\d+)\.(output_summary|output_files)\s*\}\}")
CONTEXT_LIMIT = 4_000  # characters of the original request carried to every step (head and tail, cut marked)
MAX_STEP_INPUT = 16_000  # characters of a step's input, as planned and as given again to a retry
MAX_FILES_SHOWN = 50  # of a step's output files, named to a later step (the rest counted)
_LEAST_SHOWN = 200  # a reference with less room than this left is left out, not cut to nothing
_FENCE_COST = 400  # the characters fencing one reference adds (its two markers, the lines naming its source)


class StepStatus(StrEnum):
    PENDING = "pending"
    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"
    BLOCKED = "blocked"
    WAITING_FOR_USER = "waiting_for_user"  # paused on a question to a person; resumes with the answer

    @property
    def terminal(self) -> bool:
        return self in (StepStatus.DONE, StepStatus.FAILED, StepStatus.SKIPPED, StepStatus.BLOCKED)

    @property
    def satisfies(self) -> bool:
        """A dependency in this state lets dependents run."""
        return self in (StepStatus.DONE, StepStatus.SKIPPED)


class OnFailure(StrEnum):
    ABORT_PLAN = "abort_plan"
    CONTINUE = "continue"
    ASK_LEAD = "ask_lead"


class StepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=1, description="1-based position; stable for the life of the plan")
    title: str = Field(min_length=1, max_length=200)
    assignee: str = Field(min_length=1, description="'user', the lead agent, or a sub-agent's name")
    input: str = Field(
        default="",
        max_length=MAX_STEP_INPUT,
        description="May reference {{step_N.output_summary}} and {{step_N.output_files}} of steps it waits for",
    )
    wait_for: list[int] | None = Field(default=None, description="Steps that must finish first; default: previous")
    on_failure: OnFailure = OnFailure.ASK_LEAD


class PlanSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    goal: str = Field(min_length=1, max_length=2000)
    steps: list[StepSpec] = Field(min_length=1, max_length=50)


class PlanError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def dependencies(spec: StepSpec) -> list[int]:
    if spec.wait_for is None:
        return [] if spec.index == 1 else [spec.index - 1]
    return sorted(set(spec.wait_for))


def references(spec: StepSpec) -> list[int]:
    return sorted({int(n) for n, _ in _REFERENCE.findall(spec.input)})


def validate_plan(plan: PlanSpec, assignees: set[str]) -> None:
    """Raise :class:`PlanError` listing every problem: indices, references, cycles, assignees."""
    problems: list[str] = []
    indices = [s.index for s in plan.steps]
    if sorted(indices) != list(range(1, len(indices) + 1)):
        problems.append(f"step indices must be 1..{len(indices)} without gaps or repeats, got {indices}")
    known = set(indices)
    graph: dict[int, list[int]] = {}
    for step in plan.steps:
        deps = dependencies(step)
        graph[step.index] = deps
        for dep in deps:
            if dep == step.index:
                problems.append(f"step {step.index} waits for itself")
            elif dep not in known:
                problems.append(f"step {step.index} waits for step {dep}, which does not exist")
        if step.assignee not in assignees and step.assignee != USER:
            problems.append(
                f"step {step.index} is assigned to unknown {step.assignee!r} "
                f"(known: {', '.join(sorted(assignees | {USER}))})"
            )
    cycle = _find_cycle(graph)
    if cycle:
        problems.append("steps wait for each other in a cycle: " + " -> ".join(str(i) for i in cycle))
    elif not problems:
        for step in plan.steps:
            upstream = _ancestors(step.index, graph)
            for ref in references(step):
                if ref not in upstream:
                    problems.append(f"step {step.index} uses the output of step {ref} but does not wait for step {ref}")
    if problems:
        raise PlanError(problems)


def _find_cycle(graph: dict[int, list[int]]) -> list[int]:
    state: dict[int, int] = {}
    stack: list[int] = []

    def visit(node: int) -> list[int]:
        state[node] = 1
        stack.append(node)
        for dep in graph.get(node, []):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if state.get(dep) is None and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if state.get(node) is None and (found := visit(node)):
            return found
    return []


def _ancestors(index: int, graph: dict[int, list[int]]) -> set[int]:
    seen: set[int] = set()
    todo = list(graph.get(index, []))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, []))
    return seen


@dataclass(frozen=True)
class StepRecord:
    """What a step's latest attempt did: the model, its tools with their approvals, times, tokens, cost."""

    model: str = ""
    tools: tuple[ToolUse, ...] = ()
    usage: Usage = field(default_factory=Usage)
    started_at: float | None = None  # epoch seconds
    finished_at: float | None = None
    execution: ExecutionSummary | None = None  # what its tools did (None: not said, as before this was kept)

    @property
    def seconds(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return max(0.0, self.finished_at - self.started_at)

    def line(self) -> str:
        """``model m · tools: … · 2.0 s · 10 + 5 tokens, cost 0.0010`` (empty before the step ran)."""
        if self.started_at is None:
            return ""
        took = "running" if self.seconds is None else f"{self.seconds:.1f} s"
        cost = "" if self.usage.cost is None else f", cost {self.usage.cost:.4f}"
        ran = "" if self.execution is None else f" · {self.execution.line()}"
        return (
            f"model {self.model or '-'} · tools: {tools_line(self.tools)}{ran} · {took} · "
            f"{self.usage.prompt_tokens} + {self.usage.completion_tokens} tokens{cost}"
        )


@dataclass
class Step:
    """A step and its run state. Only the executor changes the run-state fields."""

    spec: StepSpec
    status: StepStatus = StepStatus.PENDING
    output_summary: str = ""
    output_files: list[str] = field(default_factory=list)
    failure_reason: str = ""
    attempts: int = 0
    record: StepRecord = field(default_factory=StepRecord)

    @property
    def index(self) -> int:
        return self.spec.index


@dataclass(frozen=True)
class PlanOrigin:
    """What started a plan: the request as a person wrote it, who wrote it, and what they attached."""

    text: str = ""
    requested_by: str = ""  # the actor ("telegram:111") who may answer the plan's questions, with admins
    files: tuple[str, ...] = ()  # workspace paths of attachments

    @property
    def started_by(self) -> str | None:
        """Whom the plan's steps work for, as a policy's forbid_requester sees it (None: nobody known)."""
        return self.requested_by or None


def _bounded(text: str, limit: int = CONTEXT_LIMIT) -> str:
    if len(text) <= limit:
        return text
    tail = limit // 4
    cut = len(text) - (limit - tail) - tail
    return f"{text[: limit - tail]}\n[cut: {cut:,} of {len(text):,} characters not shown]\n{text[-tail:]}"


@dataclass
class Plan:
    id: str
    conversation: str
    goal: str
    steps: dict[int, Step]
    origin: PlanOrigin = field(default_factory=PlanOrigin)
    status: str = "active"

    def ready(self) -> list[Step]:
        """Pending steps whose every dependency is done or skipped, lowest index first."""
        return [
            step
            for index, step in sorted(self.steps.items())
            if step.status is StepStatus.PENDING
            and all(self.steps[d].status.satisfies for d in dependencies(step.spec))
        ]

    def in_progress(self) -> list[Step]:
        return [s for s in self.steps.values() if s.status is StepStatus.IN_PROGRESS]

    @property
    def finished(self) -> bool:
        return all(s.status.terminal for s in self.steps.values())

    def render_input(self, step: Step, *, context: bool = True) -> str:
        """The step's input with earlier steps' outputs filled in (summaries and files, never transcripts),
        followed by the plan's goal and the request that started it.

        Every one of those was written by someone other than the lead — another
        agent, a person — so each is fenced as untrusted data: the next agent
        reads it as information, not as instructions. The request is bounded,
        its cut marked, like every other context.
        """

        # What earlier steps produced, all references together, about MAX_STEP_INPUT characters at most (fences
        # included): each one is bounded, but not how many a step's input names (70 references of 1,500 characters
        # each: 1.2 MB posted, kept and sent to a model). Past the budget a reference is cut (marked) or left out.
        left = [MAX_STEP_INPUT]
        dropped: list[str] = []

        def within(content: str, source: str, what: str) -> str:
            room = left[0] - _FENCE_COST
            if room < _LEAST_SHOWN:
                dropped.append(f"{source}'s {what}")
                return "(left out)"
            shown = content if len(content) <= room else _bounded(content, room)
            left[0] -= len(shown) + _FENCE_COST
            return "\n" + fence_untrusted(shown, source=source if what == "summary" else f"files of {source}")

        def fill(match: re.Match[str]) -> str:
            ref = self.steps.get(int(match.group(1)))
            source = f"step {ref.index} ({ref.spec.assignee})" if ref else "a step"
            if match.group(2) == "output_files":
                if ref is None or not ref.output_files:
                    return "(no files)"
                files = ref.output_files[:MAX_FILES_SHOWN]
                more = len(ref.output_files) - len(files)
                return within("\n".join(files) + (f"\n(+{more} more files)" if more else ""), source, "files")
            if ref is None or not ref.output_summary:
                return "(no summary)"
            return within(ref.output_summary, source, "summary")

        text = _REFERENCE.sub(fill, step.spec.input)
        if dropped:
            shown = ", ".join(dropped[:5]) + (f" and {len(dropped) - 5} more" if len(dropped) > 5 else "")
            text += f"\n[left out, this step's input being at its limit: {shown}]"
        if not context:
            return text
        lines = [f"Plan goal: {self.goal}"]
        if self.origin.text:
            who = f" by {self.origin.requested_by}" if self.origin.requested_by else ""
            lines.append(f"The request that started it{who}:\n{_bounded(self.origin.text)}")
        if self.origin.files:
            lines.append("Attached files (in the workspace): " + ", ".join(self.origin.files))
        block = fence_untrusted("\n".join(lines), source="the plan's goal and original request")
        return f"{text}\n\n{block}" if text else block
