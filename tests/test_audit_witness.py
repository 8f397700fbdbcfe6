"""Settled cards are witnesses: each shows the signed audit checkpoint that holds its decision, and that head,
copied off a card on the Telegram fake, catches a consistent re-chained forgery of the store.

Kazma runs in-process on the three wire-level fakes with its real adapters and a SQLite store; the press is a
real callback query on the Telegram fake; `kazma audit verify` runs as the command line.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from pathlib import Path

from click.testing import CliRunner, Result

from kazma.approvals.model import Decision, Status
from kazma.bot.cli import main
from tests.audit_support import FORGER, Attacker, rechained, resigned
from tests.platforms_support import PLATFORMS, TG_ADMIN, kazma_on, three_fakes
from tests.store_backends import Engine

FOOTER = re.compile(r"Audit checkpoint:[*` ]*#(\d+) ([0-9a-f]{12})")


async def verify(config: Path, *args: str) -> Result:
    """`kazma audit verify` (in a thread: the command runs its own event loop)."""
    command = ["-c", str(config), "audit", "verify", *args]
    return await asyncio.to_thread(CliRunner().invoke, main, command, env={"KAZMA_AUDIT_KEY": ""})


async def test_every_settled_card_shows_the_checkpoint_of_its_decision_and_it_catches_a_forged_log(
    tmp_path: Path,
) -> None:
    store = tmp_path / "state" / "kazma.db"
    async with three_fakes() as fakes:
        config = tmp_path / "kazma.yaml"
        config.write_text(fakes.config_yaml(store))
        async with kazma_on(fakes, store) as app:
            request = await app.service.open("shell", {"command": "deploy --prod"}, "agent:builder", "telegram:-1001")
            await fakes.wait(lambda: all(fakes.has_buttons(p) for p in PLATFORMS), timeout=30)
            await fakes.press("telegram", Decision.APPROVE)
            await fakes.wait(lambda: not any(fakes.has_buttons(p) for p in PLATFORMS), timeout=30)
            await fakes.wait(lambda: all(FOOTER.search(fakes.card_text(p)) for p in PLATFORMS), timeout=30)
            decided = await app.service.store.get(request.id)
            assert decided is not None
            assert decided.status is Status.APPROVED
            assert decided.decided_by == f"telegram:{TG_ADMIN}"
            witness = await app.service.store.witness(request.id)
            assert witness is not None
            [decision] = await app.service.store.events(request.id, event="decided")
            assert witness.first_seq <= decision.seq <= witness.seq  # the checkpoint holds the decision
        seen = {p: FOOTER.search(fakes.card_text(p)) for p in PLATFORMS}
    # The same witness on every platform: the checkpoint's sequence number and the first 12 hex of its head.
    for platform, match in seen.items():
        assert match is not None, platform
        assert (int(match.group(1)), match.group(2)) == (witness.seq, witness.head[:12]), platform
    telegram = seen["telegram"]
    assert telegram is not None
    head = f"{telegram.group(1)}:{telegram.group(2)}"  # as a person would copy it off the card

    clean = await verify(config, "--head", head)
    assert clean.exit_code == 0, clean.stdout
    assert "1 head(s) seen elsewhere are in it" in clean.stdout

    # Whoever can write the store moves the approval to another person and chains everything again; without the
    # audit key its checkpoints are signed with a key of its own, under the same id.
    attacker = Attacker(Engine("sqlite", str(store)))
    events, checkpoints = attacker.events(), attacker.checkpoints()
    forged = rechained([replace(e, actor="telegram:999") if e.seq == decision.seq else e for e in events])
    attacker.replace_log(forged, resigned(forged, checkpoints, FORGER))
    result = await verify(config, "--head", head)
    assert result.exit_code == 1, result.stdout
    assert "bad signature" in result.stdout.splitlines()[0]
    # And the card's head itself: the forged log does not hash to what the card showed at that sequence number.
    assert f"seq {witness.seq}: changed: it hashes to" in result.stdout
    assert f"says {witness.head[:12]}" in result.stdout
