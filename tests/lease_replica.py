"""One replica competing for the leader lease, as its own OS process (``python -m tests.lease_replica DSN NAME``).

Prints one JSON line per change on stdout — ``{"event": "acquired" | "lost" | "following" | "woke", "t": <epoch>,
"replica": NAME, ...}`` (``woke``: its loop ran again after more than a second, with whether it still believed it
led) — and writes the lease's structlog events as JSON lines on stderr. Runs until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import structlog

from kazma.config.store.leader import LeaderLease


def say(event: str, replica: str, **fields: object) -> None:
    print(json.dumps({"event": event, "t": time.time(), "replica": replica, **fields}), flush=True)


async def main(dsn: str, replica: str) -> None:
    lease: LeaderLease | None = None

    async def acquired() -> None:
        say("acquired", replica, backend_pid=lease.backend_pid if lease else None)

    async def lost(reason: str) -> None:
        say("lost", replica, reason=reason)

    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    lease = LeaderLease(dsn, name="kazma", replica=replica, on_acquired=acquired, on_lost=lost)
    async with lease:
        say("started", replica, application_name=lease.application_name)
        state = lease.state
        last = time.monotonic()
        while True:  # report each time it (re)joins as a follower; a tight poll of local state only
            await asyncio.sleep(0.05)
            now = time.monotonic()
            if now - last > 1.0:  # the process was stopped (SIGSTOP) or its loop stuck: what it believes on waking
                say("woke", replica, leader=lease.is_leader, stalled=now - last)
            last = now
            if lease.state != state:
                state = lease.state
                if state == "follower":
                    say("following", replica)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
