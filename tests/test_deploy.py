"""The way to production, checked on this machine: the Dockerfile (no Docker daemon here), the systemd unit,
the LICENSE, and a README that links only to what the repository holds.

What needs an installed wheel — the image's entrypoint and its health check against a running Kazma —
is checked in tests/test_first_run.py, on the wheel built from exactly what the Dockerfile copies.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from ipaddress import ip_address, ip_network
from pathlib import Path

import pytest

from kazma.adapters.admission import FileBounds
from kazma.bot.console.server import WebServer
from kazma.bot.console.upload import largest_upload
from kazma.config.models import FilesConfig, WebConfig
from tests.deploy_support import (
    DOCKERFILE,
    REPO,
    Instruction,
    apt_packages,
    copied_sources,
    run_commands,
    stages,
)
from tests.nginx_support import (
    REPLICAS,
    SINGLE,
    body_limit,
    certificate,
    check,
    location_block,
    main_config,
    nginx_or_skip,
    with_certificate,
)

README = REPO / "README.md"
UNIT = REPO / "deploy" / "kazma.service"


def _keyword(stage: list[Instruction], keyword: str) -> list[str]:
    return [i.args for i in stage if i.keyword == keyword]


def test_the_image_is_slim_non_root_and_keeps_config_and_store_on_volumes() -> None:
    build, image = stages()
    bases = [_keyword(stage, "FROM")[0].split()[0] for stage in (build, image)]
    assert bases == ["python:3.11-slim-bookworm", "python:3.11-slim-bookworm"]
    users = _keyword(image, "USER")
    assert users == ["kazma"]
    assert any("useradd" in run and " kazma" in run for run in _keyword(image, "RUN"))
    volumes = [v for args in _keyword(image, "VOLUME") for v in (re.findall(r'"([^"]+)"', args) or args.split())]
    assert sorted(volumes) == ["/etc/kazma", "/var/lib/kazma"]
    env = " ".join(_keyword(image, "ENV"))
    assert "KAZMA_CONFIG=/etc/kazma/kazma.yaml" in env  # the configuration is on its volume
    assert _keyword(image, "WORKDIR") == ["/var/lib/kazma"]
    # relative paths in kazma.yaml start at the state volume, not at the configuration's (read-only) folder
    assert "KAZMA_BASE_DIR=/var/lib/kazma" in env
    assert "bubblewrap" in apt_packages()


def test_the_entrypoint_and_health_check_are_what_kazma_serves() -> None:
    image = stages()[-1]
    (entrypoint,) = [i.exec_form() for i in image if i.keyword == "ENTRYPOINT"]
    (command,) = [i.exec_form() for i in image if i.keyword == "CMD"]
    assert entrypoint == ["kazma"]
    assert command == ["run"]
    (health,) = [i.args for i in image if i.keyword == "HEALTHCHECK"]
    assert "CMD [" in health
    env = " ".join(i.args for i in image if i.keyword == "ENV")
    found = re.search(r"KAZMA_HEALTHZ=(\S+)", env)
    assert found is not None
    # the default health URL is the console's default port, and the path the console serves without a login
    assert found.group(1) == f"http://127.0.0.1:{WebConfig().port}/healthz"
    assert f"{WebConfig().port}" in " ".join(i.args for i in image if i.keyword == "EXPOSE")


def test_the_build_stage_copies_every_package_the_wheel_needs() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    copied = set(copied_sources())
    assert folders <= copied, sorted(folders - copied)
    assert {"pyproject.toml", "README.md", "LICENSE"} <= copied  # the metadata reads the README; the licence ships
    for source in copied:
        assert (REPO / source).exists(), source
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored
    assert ".kazma" in ignored  # a local store never goes into an image
    assert ".kazma-keys" in ignored  # nor a local decision key


def _debian_codename() -> str | None:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return None
    found = re.search(r"^VERSION_CODENAME=(\w+)", text, flags=re.MULTILINE)
    return found.group(1) if found else None


def test_the_packages_the_image_installs_exist_in_its_debian_release() -> None:
    codename = stages()[-1][0].args.split()[0].rsplit("-", 1)[-1]
    if shutil.which("apt-cache") is None or _debian_codename() != codename:
        pytest.skip(f"needs apt-cache on Debian {codename} to look the packages up (no Docker daemon to build with)")
    for package in apt_packages():
        shown = subprocess.run(
            ["apt-cache", "show", "--no-all-versions", package], capture_output=True, text=True, check=False
        )
        assert shown.returncode == 0, f"{package}: {shown.stderr}"
        assert f"Package: {package}" in shown.stdout


def test_the_programs_the_image_runs_come_with_its_base(tmp_path: Path) -> None:
    """Without a daemon to build with: every program a RUN line calls is in a Debian package of priority
    "required" (so in every Debian base image), or is Python's own (pip, from the python image)."""
    image = stages()[-1]
    codename = image[0].args.split()[0].rsplit("-", 1)[-1]
    if shutil.which("dpkg") is None or shutil.which("apt-cache") is None or _debian_codename() != codename:
        pytest.skip(f"needs dpkg and apt-cache on Debian {codename} (no Docker daemon to build with)")
    for program in sorted(set(run_commands(image)) - {"pip"}):
        found = shutil.which(program)
        assert found is not None, program
        # merged /usr: dpkg may know the file under /bin or /sbin rather than where PATH finds it
        places = [str(Path(found).resolve())] + [f"{folder}/{program}" for folder in ("/bin", "/sbin", "/usr/sbin")]
        for place in places:
            owner = subprocess.run(["dpkg", "-S", place], capture_output=True, text=True, check=False)
            if owner.returncode == 0:
                break
        assert owner.returncode == 0, f"{program}: {owner.stderr}"
        package = owner.stdout.split(":", 1)[0].split(",")[0].strip()
        shown = subprocess.run(
            ["apt-cache", "show", "--no-all-versions", package], capture_output=True, text=True, check=True
        )
        assert "Priority: required" in shown.stdout, f"{program} comes from {package}, not a required package"


def test_the_systemd_unit_verifies_and_runs_kazma_as_its_own_user(tmp_path: Path) -> None:
    text = UNIT.read_text()
    settings = dict(re.findall(r"^(\w+)=(.*)$", text, flags=re.MULTILINE))
    assert settings["User"] == "kazma"
    assert settings["UMask"] == "0077"
    assert settings["StateDirectoryMode"] == "0700"
    assert settings["Restart"] == "on-failure"
    environment = re.findall(r"^Environment=(.*)$", text, flags=re.MULTILINE)
    # kazma.yaml on /etc (read-only under ProtectSystem=strict), its relative paths from the state folder
    assert environment == ["KAZMA_CONFIG=/etc/kazma/kazma.yaml", f"KAZMA_BASE_DIR={settings['WorkingDirectory']}"]
    for forbidding in ("RestrictNamespaces", "PrivateUsers", "SystemCallFilter"):
        assert forbidding not in settings  # bubblewrap needs user namespaces
    program, *arguments = settings["ExecStart"].split()
    assert program == "/opt/kazma/bin/kazma"
    # the arguments are ones kazma accepts
    accepted = subprocess.run(
        [sys.executable, "-m", "kazma.bot.cli", *arguments, "--help"], capture_output=True, text=True, check=False
    )
    assert accepted.returncode == 0, accepted.stderr
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: the unit's syntax was not verified")
    kazma = Path(sys.executable).with_name("kazma")
    local = tmp_path / "kazma.service"
    local.write_text(
        text.replace(program, str(kazma)).replace("User=kazma", "User=root").replace("Group=kazma", "Group=root")
    )
    verified = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True, check=False)
    assert verified.returncode == 0, verified.stderr
    assert verified.stderr.strip() == "", verified.stderr  # unknown keys and bad values are only warned about


def test_the_license_is_the_apache_2_0_text_the_package_declares() -> None:
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"
    debian = Path("/usr/share/common-licenses/Apache-2.0")
    if debian.exists():
        assert text == debian.read_text()


def test_every_link_in_the_readme_points_at_something_in_the_repository() -> None:
    text = README.read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t for t in targets if not re.match(r"^[a-z]+:", t) and not t.startswith("#")]
    assert local, "the README links to the repository's own files"
    missing = [t for t in local if not (REPO / t.split("#", 1)[0]).exists()]
    assert missing == []
    assert "DESIGN" not in text  # the design notes are not part of the repository


def test_healthz_and_the_proxy_paths_are_documented() -> None:
    text = README.read_text()
    assert "## Running in production" in text
    assert "`/healthz`" in text
    for path in ("`platforms.slack.http.path` (`/slack/events`)", "`platforms.telegram.webhook.path` (`/telegram`)"):
        assert path in text
    assert "`Secure`" in text
    assert DOCKERFILE.name in text


COMPOSE = REPO / "deploy" / "compose.yaml"


def test_the_compose_file_runs_two_named_replicas_of_one_image_on_postgresql_behind_one_proxy() -> None:
    import yaml

    from kazma.config.loader import load_config_text

    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    replicas = {name: s for name, s in services.items() if s.get("image") == "kazma"}
    assert len(replicas) == 2
    names = {s["environment"]["KAZMA_REPLICA"] for s in replicas.values()}
    assert names == set(replicas)  # each replica named, and named apart
    for service in replicas.values():
        assert service["depends_on"]["postgres"]["condition"] == "service_healthy"
        assert "./kazma.yaml:/etc/kazma/kazma.yaml:ro" in service["volumes"]
        assert service["env_file"] == ["kazma.env", "postgres.env"]
    assert len({v for s in replicas.values() for v in s["volumes"] if "state" in v}) == 2  # workspaces apart
    assert services["postgres"]["image"].startswith("postgres:")
    # The proxy sends every HTTP path to every replica, on the ports kazma.yaml gives them.
    proxy_conf = (REPO / "deploy" / "nginx-replicas.conf").read_text()
    mounted = [v.split(":")[0] for v in services["proxy"]["volumes"]]
    assert "./deploy/nginx-replicas.conf" in mounted
    example = (REPO / "deploy" / "kazma.replicas.yaml").read_text()
    config = load_config_text(example, environ={"POSTGRES_PASSWORD": "secret"}).config
    assert config.store.backend == "postgresql"
    assert config.store.postgres_url is not None
    assert "@postgres:5432/" in config.store.postgres_url
    ports = {config.web.port, config.platforms.slack.http.port, config.platforms.telegram.webhook.port}
    for name in replicas:
        for port in ports:
            assert f"server {name}:{port} " in proxy_conf
    env_example = (REPO / "deploy" / "kazma.env.example").read_text()
    assert "KAZMA_WEB_TOKEN=" in env_example
    assert "POSTGRES_PASSWORD=" in (REPO / "deploy" / "postgres.env.example").read_text()
    assert "KAZMA_DECISION_KEY=" in env_example  # replicas verify each other's seals


# -- the nginx files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shipped", [SINGLE, REPLICAS], ids=["nginx.conf", "nginx-replicas.conf"])
def test_the_shipped_nginx_files_pass_nginx_t(tmp_path: Path, shipped: Path) -> None:
    nginx = nginx_or_skip()
    site = shipped.read_text()
    if "ssl_certificate" in site:  # the file's paths are a Let's Encrypt layout: a certificate of the test's own
        site = with_certificate(site, *certificate(tmp_path))
    # compose's service names resolve only inside its network, and nginx -t resolves every upstream server
    site = site.replace("server kazma-a:", "server 127.0.0.1:").replace("server kazma-b:", "server 127.0.0.2:")
    checked = check(nginx, main_config(tmp_path / "conf", site))
    assert checked.returncode == 0, checked.stderr
    assert "[warn]" not in checked.stderr, checked.stderr


@pytest.mark.parametrize("shipped", [SINGLE, REPLICAS], ids=["nginx.conf", "nginx-replicas.conf"])
def test_the_nginx_files_let_the_consoles_largest_upload_through(shipped: Path) -> None:
    site = shipped.read_text()
    files = FilesConfig()
    largest = largest_upload(FileBounds(max_bytes=files.max_bytes, max_count=files.max_count))
    assert body_limit(location_block(site, "= /console/upload")) == largest
    # everywhere else nginx's own 1 MiB stands: more than any other route of the console accepts
    assert len(re.findall(r"(?m)^\s*client_max_body_size\s", site)) == 1
    assert WebServer.BODY_LIMIT < 1024 * 1024


@pytest.mark.parametrize("shipped", [SINGLE, REPLICAS], ids=["nginx.conf", "nginx-replicas.conf"])
def test_the_nginx_files_tell_kazma_who_the_client_is(shipped: Path) -> None:
    site = shipped.read_text()
    server = site[site.index("server {") :]
    head = server[: server.index("location")]
    for header, value in (
        ("X-Forwarded-For", "$proxy_add_x_forwarded_for"),
        ("X-Forwarded-Proto", "$scheme"),
        ("Forwarded", '"for=$kazma_forwarded_for;proto=$scheme"'),
        ("Host", "$host"),
    ):
        assert re.search(rf"proxy_set_header\s+{re.escape(header)}\s+{re.escape(value)};", head), header
    # nginx drops the server's proxy_set_header lines in a location that sets any of its own
    for block in re.findall(r"location\s+[^{]+\{([^}]*)\}", server):
        assert "proxy_set_header" not in block
    assert "map $remote_addr $kazma_forwarded_for" in site


def test_the_replicas_trust_the_compose_proxy_and_only_it() -> None:
    import yaml

    from kazma.config.loader import load_config_text

    compose = yaml.safe_load(COMPOSE.read_text())
    proxy_address = ip_address(compose["services"]["proxy"]["networks"]["default"]["ipv4_address"])
    (subnet,) = [ip_network(c["subnet"]) for c in compose["networks"]["default"]["ipam"]["config"]]
    assert proxy_address in subnet
    example = (REPO / "deploy" / "kazma.replicas.yaml").read_text()
    config = load_config_text(example, environ={"POSTGRES_PASSWORD": "secret"}).config
    assert [ip_network(n) for n in config.web.trusted_proxies] == [ip_network(f"{proxy_address}/32")]


def test_the_readme_shows_the_shipped_nginx_file() -> None:
    text = README.read_text()
    found = re.search(r"\[`deploy/nginx\.conf`\]\(deploy/nginx\.conf\).*?```nginx\n(.*?)```", text, re.S)
    assert found is not None, "the README's proxy section shows deploy/nginx.conf"
    assert found.group(1) == SINGLE.read_text()
