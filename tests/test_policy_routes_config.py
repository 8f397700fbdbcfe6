"""``approvals.policies.<name>.to``: a route that cannot be followed is a configuration error naming its key.

What is attacked: a card routed to a chat the bot does not serve (it would post into any chat id typed), to a
platform that is off, to a person nobody configured or who has no identity there, or to someone who may not
decide under the policy (a card that could never be pressed); a typo'd ``on:`` silently ignored.
"""

from __future__ import annotations

import pytest

from kazma.config import ConfigError, load_config_text
from kazma.config.card_routes import CardTarget

BASE = """
people:
  alice: {telegram: 111, slack: U0ALICE01, web: alice}
  bob: {telegram: 333, web: bob}
  carol: {slack: U0CAROL01, web: carol}
  dan: {telegram: 777}
  groups:
    oncall: [alice, bob]
approvals:
  approvers: [alice, bob, carol]
  policies:
    routed: {to: TO}
platforms:
  telegram: {token: "123:abc", chats: [-1001, -1002], home_chat: -1001, admins: [111]}
"""


def _load(to: str) -> object:
    return load_config_text(BASE.replace("TO", to), environ={}).config


@pytest.mark.parametrize(
    ("to", "key", "said"),
    [
        ('["telegram:-1003"]', "to[0]", "telegram does not serve chat -1003"),
        ('["slack:C0123ABCD"]', "to[0]", "slack, which is off"),
        ('["telegram:abc"]', "to[0]", "a Telegram chat id is a non-zero integer"),
        ('["mattermost:x"]', "to[0]", "platform one of telegram, slack, discord, matrix"),
        ("[5]", "to[0]", "expected a chat"),
        ("[]", "to", "sends its cards nowhere"),
        ("[{dm: zed}]", "to[0].dm", "unknown person or group 'zed'"),
        ("[{dm: carol, via: telegram}]", "to[0].via", "carol has no telegram identity"),
        ("[{dm: carol}]", "to[0].dm", "carol has no identity on a chat platform that is on"),
        ("[{dm: alice, via: slack}]", "to[0].via", "slack is off"),
        ("[{dm: alice, via: mattermost}]", "to[0].via", "expected a chat platform"),
        ("[{dm: alice, via: matrix}]", "to[0].via", "matrix is off"),
        ("[{dm: dan}]", "to[0].dm", "dan may not decide under policy routed"),
        ("[{dm: alice, on: telegram}]", "to[0].on", "via"),
        ("[{dm: alice, by: telegram}]", "to[0].by", "expected one of: dm, via"),
    ],
)
def test_a_route_that_cannot_be_followed_is_an_error_naming_its_key(to: str, key: str, said: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _load(to)
    text = str(caught.value)
    assert f"approvals.policies.routed.{key}:" in text, text
    assert said in text, text


def test_routes_resolve_to_chats_and_each_persons_direct_messages() -> None:
    config = load_config_text(
        BASE.replace("TO", '["telegram:-1002", {dm: oncall}, {dm: alice, via: [telegram]}]'), environ={}
    ).config
    assert config.card_targets("routed") == (
        CardTarget("telegram", "-1002"),
        CardTarget("telegram", user="111", person="alice"),
        CardTarget("telegram", user="333", person="bob"),
    )
    assert config.card_targets(None) is None  # no to: every platform's home chat, as before
