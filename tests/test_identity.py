"""Who may decide and who may steer: one roster, read from the configuration, and the platform registry."""

from __future__ import annotations

import pytest

from kazma.config import load_config_text
from kazma.config.identity import Actor, ActorError, Roster
from kazma.config.registry import ACTOR_PLATFORMS, CHAT_PLATFORMS, ROUTE_PLATFORMS, chat_id_problem

YAML = """
approvals:
  approvers: ["telegram:1", "slack:U99", "web:alice", "cli:ops", "discord:5"]
platforms:
  telegram: {admins: [2]}
  slack: {admins: [U77]}
  discord: {admins: [3]}
"""


@pytest.fixture
def roster() -> Roster:
    return load_config_text(YAML, environ={}).config.roster


def test_approvers_are_the_written_approvers_plus_the_platform_admins(roster: Roster) -> None:
    assert roster.approvers_for("telegram") == {"telegram:1", "telegram:2"}
    assert roster.approvers_for("slack") == {"slack:U99", "slack:U77"}
    assert roster.approvers_for("discord") == {"discord:5", "discord:3"}
    assert roster.approvers_for("web") == {"web:alice"}
    assert roster.approvers_for("cli") == {"cli:ops"}
    assert roster.approvers_for("matrix") == frozenset()


def test_operators_are_admins_on_chat_platforms_and_approvers_on_web_and_cli(roster: Roster) -> None:
    assert roster.operators_for("telegram") == {"telegram:2"}
    assert roster.operators_for("web") == {"web:alice"}
    assert roster.operators_for("cli") == {"cli:ops"}
    assert roster.is_operator("telegram:2", "telegram")
    assert not roster.is_operator("telegram:1", "telegram")  # an approver, not an admin
    assert roster.is_operator("telegram:99", "telegram", is_admin=True)  # the platform said so


@pytest.mark.parametrize(
    ("actor", "platform"),
    [("slack:U77", "cli"), ("telegram:2", "web"), ("web:alice", "cli"), ("cli:ops", "web"), ("telegram:2", "slack")],
)
def test_an_actor_counts_only_on_its_own_platform(roster: Roster, actor: str, platform: str) -> None:
    assert not roster.is_approver(actor, platform)
    assert not roster.is_operator(actor, platform)


def test_human_operators_counts_every_identity_once(roster: Roster) -> None:
    assert roster.human_operators() == {
        "telegram:1",
        "telegram:2",
        "slack:U99",
        "slack:U77",
        "discord:5",
        "discord:3",
        "web:alice",
        "cli:ops",
    }


@pytest.mark.parametrize("text", ["telegram", "telegram:", "mattermost:1", ":1", "telegram: "])
def test_malformed_actors_are_refused_with_the_expected_form(text: str) -> None:
    with pytest.raises(ActorError, match="platform>:<user id>"):
        Actor.parse(text)


def test_actor_round_trips() -> None:
    assert str(Actor.parse("slack:U1:x")) == "slack:U1:x"
    assert Actor.parse("web:alice") == Actor("web", "alice")


def test_the_registry_is_the_one_list_of_platforms() -> None:
    assert tuple(CHAT_PLATFORMS) == ("telegram", "slack", "discord", "matrix")
    assert ACTOR_PLATFORMS == ("telegram", "slack", "discord", "matrix", "web", "cli")
    assert ROUTE_PLATFORMS == ("telegram", "slack", "discord", "matrix", "web")
    for spec in CHAT_PLATFORMS.values():
        module, _, attribute = spec.adapter.partition(":")
        assert module == f"kazma.adapters.{spec.name}"
        assert attribute.endswith("Adapter")


@pytest.mark.parametrize(
    ("platform", "chat", "ok"),
    [
        ("telegram", "-1001234567890", True),
        ("telegram", "0", False),
        ("telegram", str(2**63), False),
        ("slack", "C0123ABCD", True),
        ("slack", "D0123ABCD", True),
        ("slack", "c0123abcd", False),
        ("discord", "123456789012345678", True),
        ("discord", "-5", False),
        ("web", "room-1", True),
        ("web", "a b", False),
        ("matrix", "x", False),
    ],
)
def test_chat_ids_are_checked_by_the_registry(platform: str, chat: str, ok: bool) -> None:
    assert (chat_id_problem(platform, chat) is None) is ok
