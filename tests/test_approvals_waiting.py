"""``/approvals`` in chat and the console's Approvals page: what waits for *you*.

On the wire fakes (real libraries) and over real HTTP at the console. What is attacked: a person's list
showing requests they may not decide (another policy's approvers), ones they reviewed already (on another
door: one person, every door), ones ``forbid_requester`` bars them from; one person's doors answering
differently; a shared token's session being shown somebody's list by the name it typed.
"""

from __future__ import annotations

from pathlib import Path

from kazma.approvals.model import Decision
from kazma.bot.app import App
from tests.fakes.discord import ALICE_ID, HOME_CHANNEL_ID
from tests.platforms_support import SLACK_ADMIN, SLACK_CHANNEL, TG_ADMIN, TG_CHAT, Fakes, kazma_on, three_fakes
from tests.test_web_server import OPERATOR, READER, console

CAROL_TG = 555
PEOPLE = f"""
people:
  alice: {{telegram: {TG_ADMIN}, slack: {SLACK_ADMIN}, web: alice}}
  bob: {{telegram: 333, discord: "{ALICE_ID}", web: bob}}
  carol: {{telegram: {CAROL_TG}}}
"""
POLICIES = (
    ", approvers: [alice, bob], policies: {two: {approve: 2}, bob-only: {approvers: [bob]},"
    " no-self: {forbid_requester: true}}"
)


async def _requests(app: App) -> dict[str, str]:
    """Four pending requests: which one is which."""
    service = app.service
    two = await service.open("shell", {"command": "a"}, "agent:builder", "telegram:-1001", policy="two")
    bob_only = await service.open("deploy", {"env": "prod"}, "agent:builder", "telegram:-1001", policy="bob-only")
    reviewed = await service.open("shell", {"command": "b"}, "agent:builder", "telegram:-1001", policy="two")
    mine = await service.open(
        "shell", {"command": "c"}, "agent:builder", "telegram:-1001", policy="no-self", started_by="alice"
    )
    # alice reviewed one already, at the console: on every door it no longer waits for her
    counted = await service.decide(reviewed.id, Decision.APPROVE, actor="web:alice", platform="web")
    assert "recorded" in counted.message
    return {"two": two.id, "bob_only": bob_only.id, "reviewed": reviewed.id, "mine": mine.id}


def _listed(text: str, ids: dict[str, str]) -> set[str]:
    return {name for name, request_id in ids.items() if f"/swarm?approval={request_id}" in text}


async def _answer(fakes: Fakes, platform: str, said: str) -> str:
    """The message Kazma posted on ``platform`` (home chat) that contains ``said``."""

    def found() -> list[str]:
        if platform == "telegram":
            return [m.text for m in fakes.telegram.bot_messages(TG_CHAT) if said in m.text]
        if platform == "slack":
            return [" ".join([m.text, *m.texts()]) for m in fakes.slack.channel(SLACK_CHANNEL) if said in m.text]
        return [str(m.get("content")) for m in fakes.discord.channel_messages(HOME_CHANNEL_ID)
                if said in str(m.get("content"))]  # fmt: skip

    await fakes.wait(lambda: bool(found()))
    return found()[-1]


async def test_approvals_in_chat_lists_what_waits_for_the_person_asking_on_every_door(tmp_path: Path) -> None:
    async with (
        three_fakes() as fakes,
        kazma_on(fakes, tmp_path / "k.db", approvals=POLICIES, extra=PEOPLE) as app,
    ):
        ids = await _requests(app)
        fakes.telegram.push_message(TG_CHAT, TG_ADMIN, "/approvals")
        on_telegram = await _answer(fakes, "telegram", "Waiting for you (alice)")
        assert _listed(on_telegram, ids) == {"two"}
        assert "0 of 2 approvals" in on_telegram

        assert fakes.slack_events_url is not None
        await fakes.slack.post_command(
            fakes.slack_events_url, text="", channel=SLACK_CHANNEL, user=SLACK_ADMIN, command="/approvals"
        )
        on_slack = await _answer(fakes, "slack", "Waiting for you (alice)")
        assert _listed(on_slack, ids) == {"two"}  # the same person, the same list

        await fakes.discord.slash_command(HOME_CHANNEL_ID, name="approvals")  # bob
        on_discord = await _answer(fakes, "discord", "Waiting for you (bob)")
        assert _listed(on_discord, ids) == {"two", "bob_only", "reviewed", "mine"}
        assert "1 of 2 approvals: alice on the web" in on_discord

        fakes.telegram.push_message(TG_CHAT, CAROL_TG, "/approvals")
        on_telegram = await _answer(fakes, "telegram", "may not decide approvals")
        assert "carol" in on_telegram
        assert _listed(on_telegram, ids) == set()


async def test_the_console_approvals_page_lists_what_waits_for_the_signed_in_person(tmp_path: Path) -> None:
    async with console(tmp_path, approvers="[alice, bob], policies: {two: {approve: 2}}") as con:
        two = await con.app.service.open("shell", {"command": "a"}, "agent:builder", "web:console", policy="two")
        one = await con.open_approval({"command": "b"})
        async with con.client() as alice:
            csrf = await con.login(alice, "alice", OPERATOR)
            page = await (await alice.get(f"{con.base}/approvals")).text()
            assert '<a href="/approvals">Approvals</a>' in page
            assert "2 approval requests waiting for you (alice)" in page
            assert f"/swarm?approval={two.id}" in page
            assert f"/swarm?approval={one.id}" in page
            # the console's message box answers /approvals to her, never through an agent
            said = await (
                await alice.post(f"{con.base}/console/send", data={"csrf": csrf, "text": "/approvals"})
            ).text()
            assert "Waiting for you (alice): 2 approval requests" in said
            assert con.provider.calls == 0
            decided = await alice.post(
                f"{con.base}/approvals/{two.id}/decide", data={"csrf": csrf, "decision": "approve"},
                allow_redirects=False,
            )  # fmt: skip
            assert decided.status == 303
            page = await (await alice.get(f"{con.base}/approvals")).text()
            assert f"/swarm?approval={two.id}" not in page  # reviewed: it waits for bob now, not her
            assert f"/swarm?approval={one.id}" in page
        async with con.client() as bob:
            await con.login(bob, "bob", OPERATOR)
            page = await (await bob.get(f"{con.base}/approvals")).text()
            assert f"/swarm?approval={two.id}" in page
            assert "1 of 2 approvals: alice on the web; waiting for: bob" in page
        async with con.client() as mallory:
            await con.login(mallory, "mallory", OPERATOR)
            page = await (await mallory.get(f"{con.base}/approvals")).text()
            assert "may not decide approvals here" in page
            assert "/swarm?approval=" not in page
        async with con.client() as typed:  # the shared reader token, under alice's name: proves nobody
            reader_csrf = await con.login(typed, "alice", READER)
            said = await (
                await typed.post(f"{con.base}/console/send", data={"csrf": reader_csrf, "text": "/approvals"})
            ).text()
            assert "A shared token is nobody" in said
            answer = await typed.get(f"{con.base}/approvals")
            assert answer.status == 200
            page = await answer.text()
            assert "A shared token is nobody" in page
            assert "/swarm?approval=" not in page
