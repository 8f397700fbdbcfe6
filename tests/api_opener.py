"""One process opening approvals through the approvals API's own code on a store another process shares.

``python -m tests.api_opener ENGINE WHERE KEYS [MAX_PENDING [PREFIX]]``: opens the store (``sqlite`` file or
``postgresql`` DSN), prints ``ready``, waits for a line on stdin, then asks for ``KEYS`` requests at once,
each with its own Idempotency-Key (``<PREFIX><n>``, default ``build-<n>``) through
:meth:`ApprovalsApi.open_for` (what ``POST /api/v1/approvals`` runs after reading the body), and prints one
JSON line: ``{"answers": [[n, request id or null, status], …], "published": [request ids whose card was
published here]}``, status 201 (opened), 200 (the key's request) or the HTTP error's code.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass

from aiohttp import web

from kazma.approvals import ApprovalService, ApprovalStore
from kazma.bot.api_store import IdempotencyKeys
from kazma.bot.console.api import ApiCaller, ApprovalsApi
from kazma.config.models import KazmaConfig
from tests.approvals_support import RecordingPublisher, approvals_config
from tests.store_backends import Engine, open_store

TOKEN = "ci-" + "c" * 40


@dataclass(frozen=True)
class _Services:
    """The approvals API's services over one store, without the rest of Kazma."""

    config: KazmaConfig
    approvals: ApprovalService
    api_keys: IdempotencyKeys
    replicated: bool


async def main(engine: str, where: str, keys: int, max_pending: int, prefix: str) -> None:
    config = approvals_config(f"api: {{tokens: {{ci: {{token: '{TOKEN}', max_pending: {max_pending}}}}}}}")
    async with open_store(Engine(engine, where), application_name="kazma-api-opener") as conn:
        publisher = RecordingPublisher()
        service = ApprovalService(ApprovalStore(conn), config, publisher=publisher)
        api = ApprovalsApi(_Services(config, service, IdempotencyKeys(conn), replicated=engine == "postgresql"))
        caller = ApiCaller("ci", ("approval_requester",))
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)

        async def ask(key: int) -> list[object]:
            body = {"tool": "deploy", "arguments": {"build": key}}
            try:
                request, created = await api.open_for(caller, body, f"{prefix}{key}")
            except web.HTTPException as exc:
                return [key, None, exc.status]
            return [key, request.id, 201 if created else 200]

        answers = await asyncio.gather(*(ask(key) for key in range(keys)))
        print(json.dumps({"answers": answers, "published": [c.request_id for c in publisher.published]}), flush=True)


if __name__ == "__main__":
    count = int(sys.argv[3])
    limit = int(sys.argv[4]) if len(sys.argv) > 4 else 4 * count
    asyncio.run(main(sys.argv[1], sys.argv[2], count, limit, sys.argv[5] if len(sys.argv) > 5 else "build-"))
