"""``kazma approvals request`` where it is hardest to keep its word: interrupted (Ctrl-C, SIGTERM) while the POST
that opens the request is on its way; Kazma failing its withdrawal (500, 429); Kazma opening the request and then
failing its answer (503). A real CLI process, a real Kazma web server, and proxies on 127.0.0.1 in between."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import os
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kazma.config import failpoints
from tests.api_support import Door, first_answer_withheld, kazma_door
from tests.child_env import child_env

WITHIN = 30.0


async def interrupted(
    cli: asyncio.subprocess.Process, signum: signal.Signals, ready: Callable[[], Awaitable[None]]
) -> str:
    """``cli`` gets ``signum`` once ``ready`` returns: what it wrote to stderr by its exit (it is killed if anything
    fails before, so that no CLI outlives its test)."""
    try:
        await ready()
        cli.send_signal(signum)
        _, err = await asyncio.wait_for(cli.communicate(), WITHIN)
    finally:
        with contextlib.suppress(ProcessLookupError):
            cli.kill()
    return err.decode()


async def assert_withdrawn_as_interrupted(door: Door, cli: asyncio.subprocess.Process, err: str) -> None:
    """The CLI exited 5, Kazma holds one request, withdrawn because its asker was interrupted, and the CLI said so."""
    assert cli.returncode == 5, err
    [request] = await door.app.service.store.requests()
    assert (request.status.value, request.reason) == ("cancelled", "withdrawn: the asker's process was interrupted")
    assert f"request {request.id} withdrawn" in err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("wait", [("--wait",), ()], ids=["wait", "no-wait"])
async def test_cli_interrupted_while_its_open_is_on_the_way_withdraws_what_kazma_opened(
    tmp_path: Path, signum: signal.Signals, wait: tuple[str, ...]
) -> None:
    """Kazma opened the request (cards out) but its answer, with the id, had not come back when the CLI was
    interrupted: it withdrew nothing and said Kazma would withdraw it once nobody asked, which holds only for
    ``--wait`` and after 90 s (without ``--wait`` the request stayed approvable until its deadline; SIGTERM
    without ``--wait`` killed the process outright). It asks again with its Idempotency-Key, which answers with
    the request it opened (not a second one), and withdraws that."""
    async with kazma_door(tmp_path) as door, first_answer_withheld(door.url) as proxy:
        cli = await door.run_cli(
            "approvals", "request", "--url", proxy.url, "--tool", "deploy", "--arg", "env=prod", *wait
        )  # fmt: skip

        async def opened() -> None:
            async with asyncio.timeout(WITHIN):
                while not await door.app.service.store.requests(pending_only=True):
                    await asyncio.sleep(0.02)  # polling the store for the open Kazma made, not standing in for it

        err = await interrupted(cli, signum, opened)
        await assert_withdrawn_as_interrupted(door, cli, err)  # one request: the second ask found the first's
        assert proxy.connections == 2


async def test_cli_interrupted_after_its_open_was_lost_on_the_way_opens_it_and_withdraws_it_at_once(
    tmp_path: Path,
) -> None:
    """The POST left the CLI but never reached Kazma, and the CLI cannot tell that from an answer on its way: the
    POST sent again with the same Idempotency-Key opens the request, which is withdrawn at once (its card says
    so) - one request, ended, never one left approvable for nobody."""
    async with kazma_door(tmp_path) as door, first_answer_withheld(door.url, request_too=True) as proxy:
        cli = await door.run_cli(
            "approvals", "request", "--url", proxy.url, "--tool", "deploy", "--arg", "env=prod", "--wait"
        )  # fmt: skip

        async def lost_on_the_way() -> None:
            await asyncio.wait_for(proxy.first_request_read.wait(), WITHIN)
            assert not await door.app.service.store.requests()  # Kazma never saw it

        err = await interrupted(cli, signal.SIGINT, lost_on_the_way)
        await assert_withdrawn_as_interrupted(door, cli, err)


@contextlib.asynccontextmanager
async def withdrawals_refused(
    upstream: str, statuses: list[int], *, arrived: asyncio.Event | None = None, release: asyncio.Event | None = None
) -> AsyncIterator[str]:
    """A proxy before ``upstream`` that answers the first DELETEs with ``statuses`` (Kazma overloaded, failing
    over) without passing them on, and passes every other request on; a DELETE passed on sets ``arrived`` and
    waits for ``release`` first."""
    refusals = list(statuses)

    async def forward(request: web.Request) -> web.StreamResponse:
        if request.method == "DELETE" and refusals:
            return web.json_response({"error": "try again"}, status=refusals.pop(0), headers={"Retry-After": "1"})
        if request.method == "DELETE" and arrived is not None and release is not None:
            arrived.set()
            await release.wait()
        async with session.request(
            request.method, f"{upstream}{request.rel_url}", headers=request.headers, data=await request.read()
        ) as answered:
            return web.Response(status=answered.status, body=await answered.read(), headers=answered.headers)

    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(application)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        await site.start()
        try:
            yield f"http://127.0.0.1:{runner.addresses[0][1]}"
        finally:
            await runner.cleanup()


@pytest.mark.parametrize("statuses", [[500], [429, 503]])
async def test_cli_interrupted_asks_again_when_kazma_cannot_take_the_withdrawal_at_once(
    tmp_path: Path, statuses: list[int]
) -> None:
    """The withdrawal answered 500 (or 429): the CLI said Kazma could not be told and left the request pending,
    approvable, for the 90 s of Kazma's grace. It asks again, within its bound, and the request is withdrawn."""
    async with kazma_door(tmp_path) as door, withdrawals_refused(door.url, statuses) as url:
        cli = await door.run_cli(
            "approvals", "request", "--url", url, "--tool", "deploy", "--arg", "env=prod", "--wait"
        )  # fmt: skip

        async def has_the_id() -> None:
            assert cli.stdout is not None
            assert (await asyncio.wait_for(cli.stdout.readline(), WITHIN)).startswith(b"request ")

        err = await interrupted(cli, signal.SIGINT, has_the_id)
        await assert_withdrawn_as_interrupted(door, cli, err)


async def test_cli_takes_the_request_kazma_opened_before_its_answer_failed(tmp_path: Path) -> None:
    """Kazma opened the request (cards out), then its store failed before the answer: 503, naming the request and
    saying to ask again with the same Idempotency-Key. The CLI exited 4, "could not be asked", and left the request
    pending behind it (until its deadline without ``--wait``). It asks again with its key and waits for that
    request."""
    async with kazma_door(tmp_path) as door:
        failpoints.arm_for_test("api.open=1*error")
        try:
            cli = await door.run_cli(
                "approvals", "request", "--url", door.url, "--tool", "deploy", "--arg", "env=prod", "--wait"
            )  # fmt: skip
            try:
                await door.press("a")
                out, err = await asyncio.wait_for(cli.communicate(), WITHIN)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    cli.kill()
        finally:
            failpoints.disarm()
        assert cli.returncode == 0, err.decode()
        [request] = await door.app.service.store.requests()
        assert request.status.value == "approved"
        assert f"request {request.id}" in out.decode()


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
async def test_a_second_signal_during_the_withdrawal_does_not_cut_it_short(
    tmp_path: Path, second: signal.Signals
) -> None:
    """Ctrl-C pressed again (or the runner's SIGTERM) while the withdrawal is on its way: it is let go, the
    withdrawal is answered, and the CLI says so and exits 5 (not a traceback, not 130, not -15)."""
    arrived, release = asyncio.Event(), asyncio.Event()
    async with (
        kazma_door(tmp_path) as door,
        withdrawals_refused(door.url, [], arrived=arrived, release=release) as url,
    ):
        cli = await door.run_cli(
            "approvals", "request", "--url", url, "--tool", "deploy", "--arg", "env=prod", "--wait"
        )  # fmt: skip
        try:
            assert cli.stdout is not None
            assert (await asyncio.wait_for(cli.stdout.readline(), WITHIN)).startswith(b"request ")
            cli.send_signal(signal.SIGINT)
            await asyncio.wait_for(arrived.wait(), WITHIN)
            cli.send_signal(second)
            with pytest.raises(TimeoutError):  # still there: the second signal did not end it
                await asyncio.wait_for(asyncio.shield(cli.wait()), 0.5)
            release.set()
            _, err = await asyncio.wait_for(cli.communicate(), WITHIN)
        finally:
            release.set()
            with contextlib.suppress(ProcessLookupError):
                cli.kill()
        assert cli.returncode == 5, err.decode()
        [request] = await door.app.service.store.requests()
        assert request.status.value == "cancelled"
        assert f"request {request.id} withdrawn" in err.decode()


@pytest.mark.parametrize("answer", [b"<html>sign in</html>", b'{"error": "not here"}', b"[1, 2]"])
def test_an_answer_that_is_no_request_is_said_so_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: bytes
) -> None:
    """``--url`` at another web server (a proxy's login page, an app answering 200 to anything): the JSON decoding
    error or KeyError of its answer came out as a traceback. It says what it got, and exits 4."""
    from click.testing import CliRunner

    from kazma.bot.cli.approvals_request import request
    from kazma.bot.cli.context import Context

    class NotKazma(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotKazma)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        monkeypatch.setenv("KAZMA_API_TOKEN", "t" * 40)
        config = tmp_path / "kazma.yaml"
        config.write_text(f"store: {{path: '{tmp_path / 'k.db'}'}}\n")
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = CliRunner().invoke(request, ["--tool", "deploy", "--url", url, "--wait"], obj=Context(config))
    finally:
        server.shutdown()
        serving.join()
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 4
    assert f"the answer at {url} is no approval request (HTTP 200): is it Kazma's address?" in result.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
async def test_interrupted_while_reading_its_configuration_is_interrupted_not_denied(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """Ctrl-C while Kazma's configuration was read (for ``web.public_url``, no ``--url``): click's "Aborted!" and
    exit 1, which a script reads as "denied" (SIGTERM: -15). It is exit 5, and says nothing was opened. The
    configuration is a FIFO: opening it for writing returns once the CLI has opened it to read, then it waits for
    the text."""
    config = tmp_path / "kazma.yaml"
    os.mkfifo(config)
    env = child_env({"KAZMA_API_TOKEN": "t" * 40})
    env.pop("KAZMA_URL", None)
    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kazma.bot.cli", "-c", str(config), "approvals", "request", "--tool", "deploy", "--wait",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        writer = await asyncio.wait_for(asyncio.to_thread(os.open, config, os.O_WRONLY), WITHIN)
        try:
            cli.send_signal(signum)  # it is reading its configuration, which has not come yet
            _, err = await asyncio.wait_for(cli.communicate(), WITHIN)
        finally:
            os.close(writer)
    finally:
        with contextlib.suppress(ProcessLookupError):
            cli.kill()
    assert cli.returncode == 5, err.decode()
    assert "interrupted before the request was sent; nothing was opened" in err.decode()


def test_a_withdrawal_answered_a_byte_at_a_time_gives_up_within_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """httpx's timeout bounds each read, not the answer: a DELETE answered one byte a second (a proxy stalling)
    held the interrupted CLI, its second Ctrl-C let go, for as long as the bytes came. It gives up within its
    bound and says Kazma could not be told."""
    import httpx

    from kazma.bot.cli import approvals_request

    monkeypatch.setattr(approvals_request, "WITHDRAW_TIMEOUT", 0.5)
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
            with contextlib.suppress(OSError):
                while not done.wait(0.05):
                    conn.sendall(b" ")

    server = threading.Thread(target=trickle, daemon=True)
    server.start()
    answered: list[dict[str, Any] | None] = []
    with httpx.Client(base_url=f"http://127.0.0.1:{listener.getsockname()[1]}") as client:
        asking = threading.Thread(target=lambda: answered.append(approvals_request._withdrawn(client, "a" * 24)))
        asking.start()
        asking.join(WITHIN)
        held = asking.is_alive()
        done.set()
        asking.join()
    listener.close()
    assert not held, "the withdrawal was still reading the trickled answer"
    assert answered == [None]
