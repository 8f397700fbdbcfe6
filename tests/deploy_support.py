"""Reading the Dockerfile on a machine without a Docker daemon: its instructions, stage by stage."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, …
    args: str  # the rest, continuation lines joined

    def exec_form(self) -> list[str] | None:
        """The JSON array form (``["kazma", "run"]``), or None for the shell form."""
        text = self.args.strip()
        if not text.startswith("["):
            return None
        value = json.loads(text)
        assert isinstance(value, list)
        return [str(item) for item in value]


def instructions(path: Path = DOCKERFILE) -> list[Instruction]:
    found: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.rstrip()
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        keyword, _, args = text.partition(" ")
        found.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return found


def stages(path: Path = DOCKERFILE) -> list[list[Instruction]]:
    """The instructions of each build stage, in order (the last one is the image)."""
    result: list[list[Instruction]] = []
    for instruction in instructions(path):
        if instruction.keyword == "FROM":
            result.append([])
        assert result, "an instruction before the first FROM"
        result[-1].append(instruction)
    return result


def copied_sources(path: Path = DOCKERFILE) -> list[str]:
    """What the build stages COPY from the build context (not ``--from`` another stage)."""
    sources: list[str] = []
    for instruction in instructions(path):
        if instruction.keyword != "COPY" or instruction.args.startswith("--from"):
            continue
        words = shlex.split(instruction.args)
        sources += [word.rstrip("/") for word in words[:-1]]
    return sources


def build_context(target: Path) -> Path:
    """A copy of exactly what the Dockerfile's build stage copies, laid out as it does it."""
    for source in copied_sources():
        origin = REPO / source
        if origin.is_dir():
            shutil.copytree(origin, target / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, target / source)
    return target


def apt_packages(path: Path = DOCKERFILE) -> list[str]:
    packages: list[str] = []
    for instruction in instructions(path):
        if instruction.keyword != "RUN":
            continue
        for command in re.split(r"&&|;", instruction.args):
            words = shlex.split(command)
            if words[:2] == ["apt-get", "install"]:
                packages += [word for word in words[2:] if not word.startswith("-")]
    return packages


def run_commands(stage: list[Instruction]) -> list[str]:
    """The programs a stage's RUN lines call (the first word of each ``&&``/``;`` part)."""
    programs: list[str] = []
    for instruction in stage:
        if instruction.keyword != "RUN":
            continue
        for command in re.split(r"&&|;", instruction.args):
            words = shlex.split(command)
            if words:
                programs.append(words[0])
    return programs
