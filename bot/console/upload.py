"""Files sent from the console: read as a stream within ``files.max_bytes`` / ``files.max_count``, then handed to
the agents like any platform's attachments (saved under ``incoming/`` in the conversation's workspace).

The body is read part by part (``request.multipart()``), never whole: the console's small request bound stays as
it is for every other form, and an oversized file is refused as soon as it crosses the bound, before the rest of
it is kept anywhere. The CSRF token must come first (it is the form's first field; a header works too), so
nothing of a forged request is read beyond it. Over a bound: a clear message for the sender, nothing saved.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
from aiohttp import BodyPartReader, web

from kazma.adapters.admission import FileBounds, human_size
from kazma.adapters.contract import Attachment
from kazma.bot.console.auth import CSRF_HEADER, CSRF_REFUSED, Session, WebAuth, same_token
from kazma.bot.console.pages import message_page

log = structlog.get_logger("kazma.web")

CHUNK = 64 * 1024
MAX_FIELD = 64 * 1024  # a text field (the message said with the files); the send form's own bound applies too
# After a refusal the rest of the body is read and dropped, up to this many bytes, so the browser gets the answer
# rather than a reset connection; a larger rest is cut off.
DRAIN_LIMIT = 64 * 1024 * 1024


FORM_MARGIN = 1024 * 1024  # the message (at most MAX_FIELD), the CSRF token and every part's headers, with room


def largest_upload(bounds: FileBounds) -> int:
    """The largest body ``/console/upload`` takes whole: every file at its bound, and the form around them.

    A proxy in front must let this much through, and need not let more: ``client_max_body_size`` in
    deploy/nginx.conf and deploy/nginx-replicas.conf is this for the default ``files:`` (a test holds them
    to it). Over it, the proxy answers 413 before Kazma could explain which file was too large.
    """
    return max(1, bounds.max_count) * bounds.max_bytes + FORM_MARGIN


class UploadRefused(Exception):
    """Why the files were not taken, for the sender."""


@dataclass(frozen=True)
class Upload:
    text: str
    files: tuple[tuple[str, bytes], ...]

    def attachments(self) -> tuple[Attachment, ...]:
        def fetcher(data: bytes) -> Callable[[], Awaitable[bytes]]:
            async def fetch() -> bytes:
                return data

            return fetch

        return tuple(Attachment(name, len(data), fetcher(data)) for name, data in self.files)


async def _field(part: BodyPartReader) -> str:
    data = bytearray()
    while chunk := await part.read_chunk(CHUNK):
        data += chunk
        if len(data) > MAX_FIELD:
            raise UploadRefused(f"The field {part.name} is longer than {MAX_FIELD:,} bytes; nothing was saved.")
    return data.decode("utf-8", errors="replace")


async def _file(part: BodyPartReader, name: str, bounds: FileBounds) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk(CHUNK):
        data += chunk
        if len(data) > bounds.max_bytes:
            raise UploadRefused(
                f"Not saved: {name} is larger than {human_size(bounds.max_bytes)}; Kazma accepts files up to "
                f"{human_size(bounds.max_bytes)} (files.max_bytes). Nothing was saved."
            )
    return bytes(data)


async def read_upload(request: web.Request, auth: WebAuth, bounds: FileBounds) -> tuple[Session, Upload]:
    """The session the door let in (an operator's), its CSRF token first, then the files within the bounds.

    Raises 400/403 like :meth:`WebAuth.form`, and :class:`UploadRefused` over a bound.
    """
    session = auth.current()
    multipart = request.content_type.startswith("multipart/")
    reader = await request.multipart() if multipart else None
    supplied = request.headers.get(CSRF_HEADER, "")
    if not supplied and reader is not None:
        first = await reader.next()
        if isinstance(first, BodyPartReader) and first.name == "csrf" and first.filename is None:
            supplied = (await _field(first)).strip()
    elif not supplied:  # a plain form (within the server's small body bound): its token, then a clear 400
        field = (await request.post()).get("csrf")
        supplied = field if isinstance(field, str) else ""
    if not supplied or not same_token(supplied, session.csrf):
        log.warning("web.csrf_refused", login=session.login, path=request.path)
        raise web.HTTPForbidden(text=message_page("Refused", CSRF_REFUSED, viewer=session), content_type="text/html")
    if reader is None:
        raise web.HTTPBadRequest(
            text=message_page("Bad request", "Files are sent as multipart/form-data.", viewer=session),
            content_type="text/html",
        )
    text, files = "", list[tuple[str, bytes]]()
    try:
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise UploadRefused("Nested multipart bodies are not accepted; nothing was saved.")
            if part.filename is None:
                value = await _field(part)
                if part.name == "text":
                    text = value.strip()
                continue
            if not part.filename:
                await part.release()  # the browser's empty file input: no file chosen
                continue
            if len(files) >= bounds.max_count:
                raise UploadRefused(
                    "Kazma does not accept files here (files.max_count is 0); nothing was saved."
                    if bounds.max_count == 0
                    else f"Not saved: more than {bounds.max_count} files were sent at once; Kazma accepts at most "
                    f"{bounds.max_count} (files.max_count). Nothing was saved."
                )
            files.append((part.filename, await _file(part, part.filename, bounds)))
    except UploadRefused:
        await _drain(request)
        raise
    return session, Upload(text, tuple(files))


async def _drain(request: web.Request) -> None:
    """Read and drop what the browser is still sending (bounded), so it reads the answer instead of a reset."""
    dropped = 0
    while dropped < DRAIN_LIMIT and (chunk := await request.content.read(CHUNK)):
        dropped += len(chunk)
