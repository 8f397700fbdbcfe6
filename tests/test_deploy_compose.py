"""deploy/compose.yaml as Compose reads it: every secret through env_file:, no ${VAR} Compose would want from a shell.

Compose fills ``${VAR}`` in the file from the shell's environment and the project's ``.env`` (or ``--env-file``)
only; a service's ``env_file:`` sets that container's environment and is never used to interpolate the file.
The first test checks the file against that rule by parsing it; the second asks Compose itself (``docker compose
config``, or Debian's ``docker-compose``, which scripts/install-test-deps installs: neither needs a daemon).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kazma.config import load_config_text
from tests.deploy_support import REPO

DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
# Compose's interpolation: $$ is a literal $, else $VAR or ${VAR…} with :-, -, :?, ?, :+ or + modifiers.
_INTERPOLATION = re.compile(r"\$\$|\$\{([^}]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def _env_names(path: Path) -> set[str]:
    return {
        line.split("=", 1)[0].strip()
        for line in path.read_text().splitlines()
        if "=" in line and not line.lstrip().startswith("#")
    }


def _env_files(service: dict[str, Any]) -> list[str]:
    found = service.get("env_file") or []
    return [found] if isinstance(found, str) else [str(f) for f in found]


def _strings(node: object) -> list[str]:
    if isinstance(node, dict):
        return [s for key, value in node.items() for s in (*_strings(key), *_strings(value))]
    if isinstance(node, list):
        return [s for value in node for s in _strings(value)]
    return [node] if isinstance(node, str) else []


def test_the_compose_file_needs_no_variable_from_a_shell_and_each_container_gets_its_secrets_from_env_files() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    references = [
        match.group(0)
        for text in _strings(compose)
        for match in _INTERPOLATION.finditer(text)
        if match.group(0) != "$$"
    ]
    # a ${VAR} here would be filled from the shell or .env, never from env_file: (the old ${KAZMA_PG_PASSWORD:?…})
    assert references == []

    services = compose["services"]
    examples = {path.name.removesuffix(".example"): _env_names(path) for path in DEPLOY.glob("*.env.example")}
    for name, service in services.items():
        for env_file in _env_files(service):
            assert env_file in examples, f"{name} reads {env_file}: ship deploy/{env_file}.example"
    # PostgreSQL gets its password, and none of Kazma's tokens
    postgres_env = set().union(*(examples[f] for f in _env_files(services["postgres"])))
    assert "POSTGRES_PASSWORD" in postgres_env
    assert not {n for n in postgres_env if n.startswith(("KAZMA_", "TELEGRAM_", "SLACK_", "DISCORD_"))}
    # every variable the replicas' kazma.yaml requires is in an env file each replica reads
    example = (DEPLOY / "kazma.replicas.yaml").read_text()
    required = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", example))
    assert required, "the example reads its database password from the environment"
    for name, service in services.items():
        if service.get("image") != "kazma":
            continue
        given = set().union(*(examples[f] for f in _env_files(service)))
        assert required <= given, (name, required - given)
        environ = dict.fromkeys(given, "x")
        assert load_config_text(example, environ=environ).config.store.backend == "postgresql"


def _compose_command() -> list[str]:
    docker = shutil.which("docker")
    if docker is not None:
        plugin = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, check=False)
        if plugin.returncode == 0:
            return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    if standalone is not None:
        return [standalone]
    pytest.skip("neither `docker compose` nor `docker-compose` is installed (scripts/install-test-deps installs one)")


def test_compose_config_accepts_the_file_with_the_env_files_the_readme_names(tmp_path: Path) -> None:
    command = _compose_command()
    (tmp_path / "deploy").mkdir()
    for name in ("compose.yaml", "nginx-replicas.conf"):
        shutil.copy(DEPLOY / name, tmp_path / "deploy" / name)
    # as the README says: copy the examples, fill them in
    shutil.copy(DEPLOY / "kazma.replicas.yaml", tmp_path / "kazma.yaml")
    (tmp_path / "kazma.env").write_text(
        (DEPLOY / "kazma.env.example").read_text().replace("KAZMA_WEB_TOKEN=\n", "KAZMA_WEB_TOKEN=" + "w" * 64 + "\n")
    )
    (tmp_path / "postgres.env").write_text(
        (DEPLOY / "postgres.env.example").read_text().replace("POSTGRES_PASSWORD=\n", "POSTGRES_PASSWORD=pw-1\n")
    )
    shown = subprocess.run(
        [*command, "-f", "deploy/compose.yaml", "--project-directory", ".", "config"],
        cwd=tmp_path,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path)},  # no KAZMA_* from this shell
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    resolved = yaml.safe_load(shown.stdout)
    services = resolved["services"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == "pw-1"
    assert "KAZMA_WEB_TOKEN" not in services["postgres"]["environment"]
    for replica in ("kazma-a", "kazma-b"):
        environment = services[replica]["environment"]
        assert environment["POSTGRES_PASSWORD"] == "pw-1"  # what store.url reads, the same value PostgreSQL has
        assert environment["KAZMA_WEB_TOKEN"] == "w" * 64
        assert environment["KAZMA_REPLICA"] == replica
