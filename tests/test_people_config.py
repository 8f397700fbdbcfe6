"""``people:``: one person, their identities on every door, groups; approvers and admins naming them; and every
mistake refused with one line naming its key path."""

from __future__ import annotations

import pytest

from kazma.config import load_config_text
from kazma.config.errors import ConfigError
from kazma.config.people import person_key

PEOPLE = """
people:
  alice: {telegram: 111, slack: U0ALICE01, discord: 222, web: alice, cli: alice}
  bob: {telegram: [333, 334], web: bob}
  carol: {slack: U0CAROL01}
  groups:
    oncall: [alice, bob]
"""


def test_a_person_owns_their_identities_on_every_door() -> None:
    people = load_config_text(PEOPLE, environ={}).config.people
    assert people.person_of("telegram:111") == "alice"
    assert people.person_of("slack:U0ALICE01") == "alice"
    assert people.person_of("web:alice") == "alice"
    assert people.person_of("telegram:334") == "bob"
    assert people.person_of("telegram:999") is None
    assert people.identities("oncall") == {
        "telegram:111", "slack:U0ALICE01", "discord:222", "web:alice", "cli:alice",
        "telegram:333", "telegram:334", "web:bob",
    }  # fmt: skip
    assert people.identities("telegram:999") == {"telegram:999"}
    # for counting people: one person is one key whatever the door; an unclaimed identity is its own
    assert person_key(people, "telegram:111") == person_key(people, "slack:U0ALICE01") == "alice"
    assert person_key(people, "telegram:999") == "telegram:999"


def test_approvers_may_name_people_and_groups_each_identity_on_its_own_door() -> None:
    config = load_config_text(PEOPLE + "approvals: {approvers: [oncall, 'slack:U0CAROL01']}\n", environ={}).config
    roster = config.roster
    assert roster.is_approver("telegram:111", "telegram")
    assert roster.is_approver("web:alice", "web")
    assert roster.is_approver("telegram:334", "telegram")
    assert roster.is_approver("slack:U0CAROL01", "slack")
    assert not roster.is_approver("telegram:111", "web")  # an identity still counts only on its own door
    assert not roster.is_approver("web:carol", "web")
    assert roster.person_of("web:bob") == "bob"


def test_one_person_at_several_doors_is_one_operator() -> None:
    """The swarm refuses steering shared between people: one person with identities on three doors is one."""
    config = load_config_text(PEOPLE + "approvals: {approvers: [alice, 'slack:U0CAROL01', 'telegram:999']}\n").config
    assert config.roster.human_operators() == {"alice", "carol", "telegram:999"}  # nobody's identity: its own
    alone = load_config_text(PEOPLE + "approvals: {approvers: [alice]}\n", environ={}).config
    assert alone.roster.human_operators() == {"alice"}


def test_admins_may_name_people_by_their_ids_on_that_platform() -> None:
    config = load_config_text(PEOPLE + "platforms: {telegram: {admins: [bob, 5]}, slack: {admins: [carol]}}\n").config
    assert config.platforms.telegram.admins == [333, 334, 5]
    assert config.platforms.slack.admins == ["U0CAROL01"]
    assert config.roster.is_operator("telegram:333", "telegram")


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            "people: {alice: {telegram: 111}, bob: {telegram: 111}}",
            "people.bob.telegram: telegram:111 is claimed twice: it is already alice's (one identity belongs to one "
            "person)",
        ),
        (
            "people: {alice: {web: alice, slack: U0A}, bob: {slack: [U0B, U0A]}}",
            "people.bob.slack[1]: slack:U0A is claimed twice: it is already alice's (one identity belongs to one "
            "person)",
        ),
        (
            "people: {alice: {telegram: -100123}}",
            "people.alice.telegram: a Telegram user id is a positive integer, e.g. 111222333, got -100123",
        ),
        (
            "people: {alice: {slack: u0alice}}",
            "people.alice.slack: a Slack user id is U (or W) followed by capital letters and digits, e.g. "
            "U0123ABCD, got 'u0alice'",
        ),
        (
            "people: {alice: {discord: alice}}",
            "people.alice.discord: a Discord user id is a positive number, e.g. 123456789012345678, got 'alice'",
        ),
        (
            "people: {alice: {web: Alice Smith}}",
            "people.alice.web: a console login is 1 to 32 of a-z, 0-9, '_', '.', '-', got 'Alice Smith'",
        ),
        (
            "people: {alice: {cli: 'al ice'}}",
            "people.alice.cli: a command-line login is the system user name: 1 to 32 letters, digits, '_', '.', "
            "'-', got 'al ice'",
        ),
        (
            "people: {alice: {mattermost: 'a'}}",
            "people.alice.mattermost: unknown door (expected one of: telegram, slack, discord, matrix, web, cli)",
        ),
        (
            "people: {Alice: {web: alice}}",
            "people.Alice: a person's or group's name is a lowercase letter then up to 31 of a-z, 0-9, '_', '-', "
            "got 'Alice'",
        ),
        (
            "people: {alice: {}}",
            "people.alice: a person is a mapping of their identities (door: id), e.g. telegram: 111, web: alice; "
            "got {}",
        ),
        (
            "people: {alice: {web: alice}, groups: {oncall: [alice, zed]}}",
            "people.groups.oncall[1]: unknown person 'zed' (people: alice)",
        ),
        (
            "people: {alice: {web: alice}, groups: {alice: [alice]}}",
            "people.groups.alice: 'alice' is a person's name too: a name means one person or one group",
        ),
        (
            "people: {alice: {web: alice}}\napprovals: {approvers: [alice, zed]}",
            "approvals.approvers[1]: unknown person or group 'zed' (people: alice)",
        ),
        (
            "people: {alice: {web: alice}}\nplatforms: {telegram: {admins: [alice]}}",
            "platforms.telegram.admins[0]: 'alice' has no telegram identity under people: (add people.<name>.telegram)",
        ),
        (
            "approvals: {approvers: ['telegram:-5']}",
            "approvals.approvers[0]: a Telegram user id is a positive integer, e.g. 111222333, got 'telegram:-5'",
        ),
    ],
    ids=[
        "claimed by two people",
        "claimed in a list",
        "telegram group id as a person",
        "slack id lowercase",
        "discord id text",
        "web login with a space",
        "cli login with a space",
        "unknown door",
        "person name uppercase",
        "person without identities",
        "group naming an unknown person",
        "group named like a person",
        "approver naming nobody",
        "admin without an id there",
        "malformed raw approver",
    ],
)
def test_people_mistakes_are_one_line_with_their_key_path(text: str, line: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config_text(text, environ={})
    lines = [candidate for candidate in caught.value.lines if line in candidate]
    assert lines == [f"kazma.yaml: {line}"], caught.value.lines
    assert "\n" not in lines[0]
