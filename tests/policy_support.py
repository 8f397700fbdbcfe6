"""Shared set-up for approval-policy tests: five people on several doors and the policies they decide under."""

from __future__ import annotations

from kazma.config import KazmaConfig, load_config_text

# Five people; alice has a door on Telegram, Slack and the web, so she can press twice on two platforms.
POLICY_PEOPLE_YAML = """
people:
  alice: {telegram: 111, slack: U0ALICE01, web: alice}
  bob: {telegram: 333, web: bob}
  carol: {slack: U0CAROL01, web: carol}
  dave: {telegram: 444}
  erin: {discord: "222222222222222222"}
approvals:
  deadline_seconds: 600
  approvers: [alice, bob, carol, dave, erin]
  policies:
    two: {approve: 2}
    two-no-self: {approve: 2, forbid_requester: true}
    veto-two: {approve: 2, deny: 2}
    passkey: {step_up: true, approvers: [alice, bob]}
    ops-only: {approvers: [dave]}
tools:
  shell: {policy: two}
  "deploy/*": {policy: passkey}
"""

# (actor, platform) of one press by each of the five people.
FIVE = (
    ("telegram:111", "telegram"),
    ("telegram:333", "telegram"),
    ("slack:U0CAROL01", "slack"),
    ("telegram:444", "telegram"),
    ("discord:222222222222222222", "discord"),
)
# alice's second door
ALICE_ON_SLACK = ("slack:U0ALICE01", "slack")


def policy_config(extra: str = "") -> KazmaConfig:
    return load_config_text(POLICY_PEOPLE_YAML + extra).config
