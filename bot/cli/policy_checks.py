"""``kazma doctor``'s check of approval policies against the store: a ``step_up`` policy can only be met by
people holding a passkey, so it needs at least ``approve`` of its approvers with one enrolled (the config
check already made sure that many have a web identity; only the store knows who enrolled)."""

from __future__ import annotations

from kazma.bot.cli.checks import Check, Level
from kazma.bot.console.accounts import AccountStore
from kazma.bot.store import store_for_command
from kazma.config import LoadedConfig
from kazma.config.people import person_key

POLICY_CHECK = "approval policies"


async def check_policy_passkeys(loaded: LoadedConfig) -> list[Check]:
    config = loaded.config
    stepping = {name: p for name, p in config.approvals.policies.items() if p.step_up}
    if not stepping:
        return []
    try:
        async with store_for_command(config, read_only=True) as opened:
            enrolled = {p.person for p in await AccountStore(opened).passkeys(revoked=False)}
    except Exception as exc:
        said = str(exc).strip() or type(exc).__name__
        return [Check(POLICY_CHECK, Level.FAIL, f"cannot read the enrolled passkeys: {said}")]
    checks: list[Check] = []
    for name, policy in stepping.items():
        deciders = {person_key(config.people, i) for i in config.roster.deciders(policy.approvers)}
        holding = sorted(deciders & enrolled)
        where = f"approvals.policies.{name}.step_up"
        if len(holding) < policy.approve:
            without = ", ".join(sorted(deciders - enrolled)) or "nobody"
            checks.append(Check(
                POLICY_CHECK, Level.FAIL,
                f"{where}: {policy.approve} passkeys needed to approve, {len(holding)} of its approvers hold one "
                f"({', '.join(holding) or 'nobody'}); nothing under it can be approved until more enrol "
                f"(kazma people invite <person>; without one: {without})",
            ))  # fmt: skip
        else:
            checks.append(Check(POLICY_CHECK, Level.OK, f"{where}: approvers with a passkey: {', '.join(holding)}"))
    return checks
