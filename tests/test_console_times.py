"""Every console page writes every time one way: a ``<time>`` in UTC that the script shows in the viewer's zone.

No page may state a time in any other way (a second format, a bare epoch), or the same page would mix formats
once the script has localised the ``<time>`` elements.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from pathlib import Path

from kazma.bot.console.times import times_in, when_html
from kazma.engine.swarm.types import TaskStatus
from tests.test_web_server import OPERATOR, console

TIME = re.compile(r'<time datetime="([^"]+)">([^<]*)</time>')
FORMAT = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} UTC")
# what a time written any other way would look like
STRAY = (
    re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}"),
    re.compile(r"\b\d{1,2}:\d{2}:\d{2}\b"),
    re.compile(r"\b1[6-9]\d{8}(\.\d+)?\b"),  # epoch seconds of this decade
)


def assert_one_format(page: str, where: str) -> int:
    """Every ``<time>`` in the one format and naming its own instant; no time stated outside one. Returns how many."""
    found = TIME.findall(page)
    for stamp, shown in found:
        assert FORMAT.fullmatch(shown), (where, shown)
        instant = datetime.fromisoformat(stamp).replace(microsecond=0)  # shown to the second
        assert instant == datetime.strptime(shown, "%Y-%m-%d %H:%M:%S UTC").replace(tzinfo=UTC), (where, stamp, shown)
    rest = TIME.sub("", page)
    for stray in STRAY:
        match = stray.search(rest)
        assert match is None, f"{where}: a time outside <time>: …{rest[max(0, match.start() - 80) : match.end() + 40]}…"
    return len(found)


async def test_every_console_page_uses_the_one_time_format(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as op:
        csrf = await con.login(op, "alice", OPERATOR)
        await op.post(f"{con.base}/console/send", data={"csrf": csrf, "text": "hello at noon"})
        request = await con.open_approval({"command": "ls"})
        await op.post(f"{con.base}/approvals/{request.id}/decide", data={"csrf": csrf, "decision": "approve"})
        # a remembered approval's audit row states its end in epoch seconds
        await con.app.service.store.audit(request.id, "rule_created", detail=f"r1 until {time.time() + 3600:.0f}")
        started = await op.post(f"{con.base}/swarm/command", data={"csrf": csrf, "text": "dispatch researcher look"})
        task_id = re.search(r"swarm task (\S+) started", await started.text())
        assert task_id is not None
        assert await con.app.swarm.wait(task_id.group(1), 10) is not None
        listed = await (await op.post(f"{con.base}/swarm/command", data={"csrf": csrf, "text": "list"})).text()

        pages = {
            "console": await (await op.get(f"{con.base}/")).text(),
            "conversations": await (await op.get(f"{con.base}/conversations")).text(),
            "approval": await (await op.get(f"{con.base}/swarm?approval={request.id}")).text(),
            "dashboard": await (await op.get(f"{con.base}/swarm")).text(),
            "swarm list answer": listed,
        }
        summaries = await con.app.transcript.conversations()
        for summary in summaries:
            url = f"{con.base}/conversations/{summary.conversation}"
            pages[summary.conversation] = await (await op.get(url)).text()
        counted = {where: assert_one_format(page, where) for where, page in pages.items()}
        assert all(counted.values()), counted  # every page shows times, and all of them the one way
        assert "approved by alice (web:alice) via web at <time" in pages["approval"]  # the decision's time too
        assert "r1 until <time" in pages["approval"]
        assert task_id.group(1) in listed
        record = await con.app.swarm.store.get(task_id.group(1))
        assert record is not None
        assert record.status is not TaskStatus.RUNNING


def test_times_in_text_become_time_elements() -> None:
    at = datetime(2026, 12, 1, 14, 3, 9, tzinfo=UTC)
    assert times_in("task x  running 2026-12-01 14:03:09 UTC  step") == f"task x  running {when_html(at)}  step"
    assert times_in("r1 until 1796133789") == f"r1 until {when_html(1796133789.0)}"
    assert times_in("nothing 12:30 here") == "nothing 12:30 here"
