"""Debian's nginx for the tests of the shipped proxy files (deploy/nginx*.conf): checked with ``nginx -t``, and
run in front of a real console. scripts/install-test-deps installs it; without it these tests skip, saying so.

A shipped file is a ``conf.d`` file: nginx reads it inside its ``http`` block. Here it is included from a main
configuration of the test's own (its pid, logs and temporary files in the test's folder; one foreground
process, so it runs unprivileged or as root alike). What a test changes in the copy it runs is said where it
does it: the certificate paths, the listening address and where it forwards to.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.deploy_support import REPO

SINGLE = REPO / "deploy" / "nginx.conf"
REPLICAS = REPO / "deploy" / "nginx-replicas.conf"
SIZES = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def nginx_or_skip() -> str:
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)
    if found is None:
        pytest.skip("nginx is not installed (scripts/install-test-deps installs Debian's nginx-light)")
    return found


def certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, made with the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate for nginx")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
         "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def with_certificate(site: str, cert: Path, key: Path) -> str:
    site = re.sub(r"(?m)^(\s*ssl_certificate)\s+\S+;", rf"\1     {cert};", site)
    return re.sub(r"(?m)^(\s*ssl_certificate_key)\s+\S+;", rf"\1 {key};", site)


def main_config(folder: Path, site: str) -> Path:
    """``folder/nginx.conf``: a main configuration that includes ``site`` in its http block."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "site.conf").write_text(site)
    temp = "\n".join(
        f"    {kind}_temp_path {folder / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    main = folder / "nginx.conf"
    main.write_text(
        "daemon off;\nmaster_process off;\n"
        f"pid {folder / 'nginx.pid'};\nerror_log {folder / 'error.log'} notice;\n"
        "events { worker_connections 256; }\n"
        f"http {{\n    access_log off;\n{temp}\n    include {folder / 'site.conf'};\n}}\n"
    )
    return main


def check(nginx: str, main: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [nginx, "-t", "-q", "-p", str(main.parent), "-e", str(main.parent / "error.log"), "-c", str(main)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip


def location_block(site: str, location: str) -> str:
    found = re.search(r"location\s+" + re.escape(location) + r"\s*\{([^}]*)\}", site)
    assert found is not None, f"no location {location} in the file"
    return found.group(1)


def body_limit(block: str) -> int:
    found = re.search(r"client_max_body_size\s+(\d+)([kKmMgG]?);", block)
    assert found is not None, "no client_max_body_size"
    return int(found.group(1)) * SIZES[found.group(2).lower()]


@contextlib.asynccontextmanager
async def running(nginx: str, main: Path, port: int) -> AsyncIterator[None]:
    """nginx in the foreground on ``main``, ready once ``port`` accepts; stopped (and waited for) after."""
    process = await asyncio.create_subprocess_exec(
        nginx, "-p", str(main.parent), "-e", str(main.parent / "error.log"), "-c", str(main),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(15):
            while True:
                if process.returncode is not None:
                    raise AssertionError(f"nginx stopped: {(main.parent / 'error.log').read_text()}")
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    await asyncio.sleep(0.05)  # polling a port that is not listening yet, bounded above
                    continue
                writer.close()
                break
        yield
    finally:
        if process.returncode is None:
            process.terminate()
        async with asyncio.timeout(15):
            await process.wait()
