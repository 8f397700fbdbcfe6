"""Slack's App Home: opening the app's Home tab shows that person what waits for a decision, each with its
approval page, and whether they may decide — published with ``views.publish`` by slack-bolt's
``app_home_opened`` listener, against the wire-level Slack fake (which refuses a view Slack would). The Messages
tab publishes nothing (it is a DM). The manifest turns both tabs on and subscribes to the event, since Slack
lets nobody DM an app whose Messages tab is off.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from kazma.adapters.slack.setup import slack_manifest
from kazma.approvals.model import Decision, PressVerdict
from kazma.config import load_config_text
from kazma.config.metrics import failure_count
from tests.platforms_support import SLACK_ADMIN, kazma_on, three_fakes

STRANGER = "U0STRANGER"


def _texts(view: dict[str, Any]) -> list[str]:
    found: list[str] = []
    for block in view["blocks"]:
        if "text" in block:
            found.append(str(block["text"]["text"]))
        found += [str(e.get("text", "")) for e in block.get("elements", [])]
    return found


async def test_the_home_tab_lists_what_waits_with_its_page_for_an_approver_and_a_reader(tmp_path: Path) -> None:
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        first = await app.service.open("shell", {"command": "ls"}, "agent:builder", "telegram:-1001")
        second = await app.service.open("deploy", {"env": "prod"}, "agent:<!here> <@U0ADMIN01>", "slack:C0HOME0001")
        decided = await app.service.open("shell", {"command": "pwd"}, "agent:builder", "telegram:-1001")
        await app.service.decide(decided.id, Decision.DENY, actor="telegram:111", platform="telegram")
        assert fakes.slack_events_url is not None

        await fakes.slack.post_event(fakes.slack_events_url, fakes.slack.app_home_opened(SLACK_ADMIN))
        await fakes.slack.wait_for(lambda: SLACK_ADMIN in fakes.slack.home_tabs, timeout=20)
        view = fakes.slack.home_tabs[SLACK_ADMIN]
        texts = _texts(view)
        shown = "\n".join(texts)
        assert view["type"] == "home"
        assert f"You are *slack:{SLACK_ADMIN}*: an approver here." in texts
        assert "Waiting for a decision (2)" in texts
        assert shown.index(f"/swarm?approval={first.id}|Full call>") < shown.index(f"/swarm?approval={second.id}|")
        assert "shell, asked by agent:builder in telegram:-1001" in shown
        assert decided.id not in shown  # decided: nothing waits
        assert "<!here>" not in shown  # a requester's words never ping or link
        assert "<@U0ADMIN01>" not in shown
        assert "agent:&lt;!here&gt; &lt;@U0ADMIN01&gt;" in shown

        # someone who is not an approver sees the same list, and is told they cannot decide
        await fakes.slack.post_event(fakes.slack_events_url, fakes.slack.app_home_opened(STRANGER))
        await fakes.slack.wait_for(lambda: STRANGER in fakes.slack.home_tabs, timeout=20)
        assert f"You are *slack:{STRANGER}*: not an approver here, so you can read but not decide." in _texts(
            fakes.slack.home_tabs[STRANGER]
        )

        # the Messages tab is a DM: nothing is published for it
        published = len(fakes.slack.calls_to("views.publish"))
        await fakes.slack.post_event(fakes.slack_events_url, fakes.slack.app_home_opened("U0OTHER01", tab="messages"))
        await fakes.slack.post_event(fakes.slack_events_url, fakes.slack.app_home_opened(STRANGER))
        await fakes.slack.wait_for(lambda: len(fakes.slack.calls_to("views.publish")) == published + 1, timeout=20)
        assert "U0OTHER01" not in fakes.slack.home_tabs


def test_the_manifest_turns_on_the_home_and_messages_tabs_and_asks_for_the_event() -> None:
    config = load_config_text(
        "platforms: {slack: {bot_token: xoxb-1, app_token: xapp-1-A-b, home_channel: C0HOME0001}}", environ={}
    ).config
    manifest = json.loads(json.dumps(slack_manifest(config)))
    assert manifest["features"]["app_home"] == {
        "home_tab_enabled": True,
        "messages_tab_enabled": True,
        "messages_tab_read_only_enabled": False,
    }
    assert "app_home_opened" in manifest["settings"]["event_subscriptions"]["bot_events"]


DAVE = "U0DAVE0001"
# dave approves only what the deploys policy covers (shell here); alice only what the default policy covers.
BY_POLICY = f"""
people:
  alice: {{slack: {SLACK_ADMIN}}}
  dave: {{slack: {DAVE}}}
tools:
  shell: {{policy: deploys}}
"""


async def test_the_home_tab_judges_each_request_by_its_policy_as_a_press_is_judged(tmp_path: Path) -> None:
    # The home page asked approvals.approvers alone: dave, named only by a policy's approvers, was told he could
    # not decide anything, though his presses on its cards count; alice was shown as deciding everything.
    async with (
        three_fakes() as fakes,
        kazma_on(
            fakes, tmp_path / "k.db", approvals=", approvers: [alice], policies: {deploys: {approvers: [dave]}}",
            extra=BY_POLICY,
        ) as app,
    ):  # fmt: skip
        deploy = await app.service.open("shell", {"command": "make deploy"}, "agent:builder", "telegram:-1001")
        write = await app.service.open("write_file", {"path": "a.txt", "content": "x"}, "agent:builder", "web:c")
        assert fakes.slack_events_url is not None

        async def home_of(user: str) -> dict[str, str]:
            await fakes.slack.post_event(fakes.slack_events_url or "", fakes.slack.app_home_opened(user))
            await fakes.slack.wait_for(lambda: user in fakes.slack.home_tabs, timeout=20)
            texts = _texts(fakes.slack.home_tabs[user])
            lines = {r.id: next(t for t in texts if f"approval={r.id}|" in t) for r in (deploy, write)}
            return {"standing": next(t for t in texts if t.startswith("You are")), **lines}

        dave = await home_of(DAVE)
        assert dave["standing"] == f"You are *dave (slack:{DAVE})*: an approver here."
        assert "not yours to decide" not in dave[deploy.id]
        assert "not yours to decide under its policy" in dave[write.id]
        alice = await home_of(SLACK_ADMIN)
        assert alice["standing"] == f"You are *alice (slack:{SLACK_ADMIN})*: an approver here."
        assert "not yours to decide under its policy" in alice[deploy.id]
        assert "not yours to decide" not in alice[write.id]
        stranger = await home_of(STRANGER)
        assert "not an approver here" in stranger["standing"]
        assert "not yours to decide" not in stranger[deploy.id] + stranger[write.id]  # said once, above
        # what the page says is what a press gets
        refused = await app.service.decide(write.id, Decision.DENY, actor=f"slack:{DAVE}", platform="slack")
        assert refused.verdict is PressVerdict.REFUSED
        won = await app.service.decide(deploy.id, Decision.DENY, actor=f"slack:{DAVE}", platform="slack")
        assert won.verdict is PressVerdict.WON


async def test_a_home_tab_slack_refuses_to_publish_counts_once(tmp_path: Path) -> None:
    """views.publish answered 500: the kit counted the failed call at ``home`` and the listener counted the same
    failure again there, so ``kazma_failures_total{site="home"}`` read two for one Home tab not shown."""
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db"):
        assert fakes.slack_events_url is not None
        fakes.slack.fail("views.publish", "500")
        before = failure_count("home", "slack")
        await fakes.slack.post_event(fakes.slack_events_url, fakes.slack.app_home_opened(SLACK_ADMIN))
        async with asyncio.timeout(20):  # both counts, when there were two, came in one step of the listener
            while failure_count("home", "slack") == before:
                await asyncio.sleep(0.02)
        assert failure_count("home", "slack") == before + 1
        assert SLACK_ADMIN not in fakes.slack.home_tabs
