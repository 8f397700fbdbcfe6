"""A TCP proxy in front of the test PostgreSQL that a test can cut: one replica's link to the database fails.

``cut()`` closes every connection through the proxy and refuses new ones (a replica that lost its network
to the database: its sessions end, reconnecting fails at once); ``restore()`` lets connections through
again. ``hold_new()`` lets the connections made keep going and takes new ones without a word (a server that
accepts TCP but does not answer a startup: its processes stopped, its backlog full). Only the replica whose
``store.url`` points here is affected.
"""

from __future__ import annotations

import asyncio
import contextlib


class CuttableProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.cut_off = False
        self.holding = False
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for pipe in list(self._pipes):
            pipe.cancel()

    def cut(self) -> None:
        self.cut_off = True
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    def restore(self) -> None:
        self.cut_off = False
        self.holding = False

    def hold_new(self) -> None:
        self.holding = True

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            writer.close()
            return
        if self.holding:  # never answered; closed by cut() or stop()
            self._writers.add(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            pipe = asyncio.create_task(self._pipe(source, sink))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                sink.close()
            self._writers.discard(sink)
