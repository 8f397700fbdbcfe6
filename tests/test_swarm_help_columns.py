"""``/swarm help`` keeps its columns on every platform: its lines line up with spaces, which only a fixed-width
font keeps, and chat text is proportional. Asked on Telegram, Slack and Discord (the real adapters on the wire
fakes), the answer comes back whole in each platform's fixed-width form — a ``pre`` entity over the text on
Telegram (plain text, nothing to escape), a code block on Slack and Discord that nothing in it can close — and
its lines are exactly the help's, so every description starts in the same column.
"""

from __future__ import annotations

import html
from pathlib import Path

from kazma.adapters.chat_text import Columns
from kazma.engine.swarm.grammar import help_text
from tests.fakes.discord import HOME_CHANNEL_ID
from tests.fakes.telegram import utf16_len
from tests.platforms_support import SLACK_ADMIN, SLACK_CHANNEL, TG_ADMIN, TG_CHAT, kazma_on, three_fakes

ZWSP = "\u200b"
MARK = "/swarm pipeline <preset|w1,w2,…> <task>"  # a line of the help: the answer has come


def _columns(lines: list[str]) -> set[int]:
    """Where each subcommand's "(reading, …)" / "(admin)" column starts."""
    return {line.index("  (") + 2 for line in lines if line.startswith("/swarm ") and "  (" in line}


def _inside(fenced: str) -> str:
    assert fenced.startswith("```\n"), fenced[:40]
    assert fenced.endswith("\n```"), fenced[-40:]
    return fenced[4:-4].replace(ZWSP, "")


async def test_swarm_help_is_fixed_width_on_every_platform(tmp_path: Path) -> None:
    expected = help_text()
    assert isinstance(expected, Columns)
    assert len(_columns(expected.splitlines())) == 1  # one column, lined up with spaces

    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db"):
        fakes.telegram.push_message(TG_CHAT, TG_ADMIN, "/swarm help")
        assert fakes.slack_events_url is not None
        await fakes.slack.post_command(fakes.slack_events_url, text="help", channel=SLACK_CHANNEL, user=SLACK_ADMIN)
        await fakes.discord.slash_command(HOME_CHANNEL_ID, options={"args": "help"})

        # Telegram: one message, the help as plain text with a pre entity over all of it (the prefix left out)
        await fakes.telegram.wait_until(lambda: any(MARK in m.text for m in fakes.telegram.bot_messages(TG_CHAT)),
                                        timeout=30)  # fmt: skip
        [answer] = [m for m in fakes.telegram.bot_messages(TG_CHAT) if MARK in m.text]
        start = answer.text.index(expected.splitlines()[0])
        assert answer.text[start:] == expected
        assert {"type": "pre", "offset": utf16_len(answer.text[:start]), "length": utf16_len(expected)} in [
            {k: e[k] for k in ("type", "offset", "length")} for e in answer.entities
        ]

        # Slack: in a code block, the text escaped inside it as everywhere
        await fakes.slack.wait_for(
            lambda: any(MARK in html.unescape(m.text) for m in fakes.slack.channel(SLACK_CHANNEL))
        )
        [posted] = [m for m in fakes.slack.channel(SLACK_CHANNEL) if MARK in html.unescape(m.text)]
        body = posted.text[posted.text.index("```") :]
        assert html.unescape(_inside(body)) == expected

        # Discord: in code blocks (the help is longer than one message), the parts joined back are the help
        def discord_parts() -> list[str]:
            return [
                str(m["content"])
                for m in fakes.discord.channel_messages(HOME_CHANNEL_ID)
                if "```" in str(m.get("content", ""))
            ]

        await fakes.discord.wait_until(lambda: any(MARK in p for p in discord_parts()), timeout=30)
        await fakes.discord.wait_until(lambda: "\n".join(_inside(p[p.index("```"):]) for p in discord_parts())
                                       == expected, timeout=30)  # fmt: skip
        for part in discord_parts():
            assert len(part) <= 2000
