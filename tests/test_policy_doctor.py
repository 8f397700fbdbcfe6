"""``kazma doctor`` says when a step_up policy cannot be met because too few of its approvers hold a passkey."""

from __future__ import annotations

from pathlib import Path

from kazma.bot.cli.checks import Level
from kazma.bot.cli.policy_checks import check_policy_passkeys
from kazma.bot.console.accounts import AccountStore, Passkey
from kazma.bot.store import open_store, store_for_command
from kazma.config import load_config_text

CONFIG = """
store: {{path: '{db}'}}
people:
  alice: {{web: alice}}
  bob: {{web: bob}}
approvals:
  approvers: [alice, bob]
  policies:
    production: {{step_up: true, approve: 2}}
"""


async def test_step_up_without_enough_enrolled_passkeys_is_a_doctor_failure(tmp_path: Path) -> None:
    loaded = load_config_text(CONFIG.format(db=tmp_path / "k.db"), environ={})
    await (await open_store(loaded.config)).close()  # as `kazma run` makes it: the CLI never does
    [nobody] = await check_policy_passkeys(loaded)
    assert nobody.level is Level.FAIL
    assert "approvals.policies.production.step_up" in nobody.detail
    assert "0 of its approvers hold one" in nobody.detail

    async with store_for_command(loaded.config) as opened:
        accounts = AccountStore(opened)
        for person in ("alice", "bob"):
            token, _ = await accounts.invite(person, created_by="test")
            await accounts.enrol(token, Passkey(f"cred-{person}", person, "pk", 0, "passkey 1", 0.0, None, None, None))
        await accounts.revoke(person="bob", credential_id=None, by="test")
    [one] = await check_policy_passkeys(loaded)
    assert one.level is Level.FAIL  # bob's was revoked: one of the two needed
    assert "1 of its approvers hold one (alice)" in one.detail

    async with store_for_command(loaded.config) as opened:
        accounts = AccountStore(opened)
        token, _ = await accounts.invite("bob", created_by="test")
        await accounts.enrol(token, Passkey("cred-bob-2", "bob", "pk", 0, "passkey 2", 0.0, None, None, None))
    [ok] = await check_policy_passkeys(loaded)
    assert ok.level is Level.OK
    assert "alice, bob" in ok.detail
