"""A conversation's ``<platform>:<chat>`` and an actor's ``<platform>:<user id>`` are made and read in one place:
:class:`~kazma.config.address.Address` and :class:`~kazma.config.address.Actor`. Everywhere else the source
holds the values; a string is parsed once, where it comes in (the configuration, a stored row, an API body,
command text), with their parsers.

The walk finds every f-string that is two values joined by a colon (``f"{platform}:{chat}"``) or a platform's
name, a colon and a value (``f"web:{login}"``), and every ``.partition(":")``, ``.rpartition(":")``,
``.split(":")`` and ``.rsplit(":")``. Colons that join or split something else (a key id and its secret, a host
and its port) are listed below, each with what they are.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kazma.adapters.contract import CardRef, Inbound, Press
from kazma.config.address import Actor, ActorError, Address, AddressError, platform_of
from kazma.config.registry import ACTOR_PLATFORMS

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("config", "approvals", "adapters", "engine", "bot")

# (file, the expression as written) -> what it joins or splits, when it is not an address or an actor.
NOT_ADDRESSES: dict[tuple[str, str], str] = {
    ("config/address.py", 'text.partition(":")'): "the one parser of addresses and actors",
    ("config/address.py", 'actor.partition(":")'): "platform_of: an actor's platform, its one reader",
    ("config/address.py", 'f"{self.platform}:{self.chat}"'): "the one formatter of a conversation",
    ("config/address.py", 'f"{self.platform}:{self.user}"'): "the one formatter of an actor",
    ("config/registry/__init__.py", 'f"{self.name}:{uid}"'): (
        "a platform's admins as actors: the registry sits below Actor (whose parser reads the registry)"
    ),
    ("config/registry/__init__.py", 'reference.partition(":")'): "a registry entry's module:attribute",
    ("adapters/press_policy.py", 'k.split(":", 1)'): "a replay key's kind (sig:…): logged without the key itself",
    ("config/failpoints.py", 'action.partition(":")'): "a failpoint's action and its argument (delay:50)",
    ("config/keyring.py", 'entry.partition(":")'): "a key id and its key",
    ("config/keyring.py", 'f"{key_id}:{written}"'): "a key id and its key",
    ("config/models.py", 'userinfo[0].partition(":")'): "a store URL's user and password",
    ("config/store/leader.py", 'f"{socket.gethostname()}:{os.getpid()}"'): "a lease holder: host and process",
    ("approvals/checkpoints.py", 'seal.partition(":")'): "a checkpoint's seal: key id, first row, MAC",
    ("approvals/checkpoints.py", 'rest.partition(":")'): "a checkpoint's seal: key id, first row, MAC",
    ("approvals/checkpoints.py", 'entry.partition(":")'): "a key id and its key",
    ("approvals/approval_checks.py", '(e.detail or "").split(":", 1)'): "an audit row's detail: the status, then why",
    ("adapters/kit.py", 'key.split(":", 1)'): "a signed request's key: its kind, then its value",
    ("adapters/telegram/adapter.py", "f\"{self._bot_id}:{u['update_id']}\""): "an update's key: bot id, update id",
    ("adapters/telegram/adapter.py", 'f"{self._bot_id}:{update.update_id}"'): "an update's key: bot id, update id",
    ("engine/tools/mcp_launch.py", 'f"{os.path.dirname(command)}:{SANDBOX_PATH}"'): "a PATH variable",
    ("bot/console/forwarded.py", 'value.partition(":")'): "an X-Forwarded-For host and port",
    ("bot/console/platform_signin.py", 'f"{provider.name}:{state}"'): "a sign-in challenge's subject: its state",
}


def colons(root: Path) -> list[tuple[str, str, int]]:
    """(file, expression, line) of every colon joined or split by hand in the source below ``root``."""
    found = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            relative = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(text)):
                if _joined(node) or _split(node):
                    found.append((relative, ast.get_source_segment(text, node) or "", getattr(node, "lineno", 0)))
    return found


def _joined(node: ast.AST) -> bool:
    if not isinstance(node, ast.JoinedStr):
        return False
    if len(node.values) == 2:  # f"web:{login}"
        prefix, value = node.values
        return (
            isinstance(prefix, ast.Constant)
            and isinstance(value, ast.FormattedValue)
            and str(prefix.value).removesuffix(":") in ACTOR_PLATFORMS
            and str(prefix.value).endswith(":")
        )
    if len(node.values) != 3:
        return False
    first, middle, last = node.values
    return (
        isinstance(first, ast.FormattedValue)
        and isinstance(middle, ast.Constant)
        and middle.value == ":"
        and isinstance(last, ast.FormattedValue)
    )


def _split(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("partition", "rpartition", "split", "rsplit")
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == ":"
    )


def test_no_address_or_actor_is_joined_or_split_by_hand() -> None:
    by_hand = [f"{path}:{line}: {code}" for path, code, line in colons(ROOT) if (path, code) not in NOT_ADDRESSES]
    assert not by_hand, "use Address / Actor (kazma.config.address) instead:\n" + "\n".join(by_hand)


def test_the_list_holds_only_colons_still_in_the_source() -> None:
    present = {(path, code) for path, code, _ in colons(ROOT)}
    stale = sorted(set(NOT_ADDRESSES) - present)
    assert not stale, f"remove from NOT_ADDRESSES, the source no longer has them: {stale}"


def test_the_walk_finds_a_joined_and_a_split_colon(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "hand.py").write_text(
        "def f(platform: str, chat: str, key: str) -> object:\n"
        '    where = f"{platform}:{chat}"\n'
        '    p, _, c = key.partition(":")\n'
        '    return where, f"{platform}: {chat}", f"x:{chat}", key.split(","), f"web:{chat}", f"web:{chat} says"\n'
    )
    assert colons(tmp_path) == [
        ("engine/hand.py", 'f"{platform}:{chat}"', 2),
        ("engine/hand.py", 'key.partition(":")', 3),
        ("engine/hand.py", 'f"web:{chat}"', 4),
    ]


def test_an_address_is_written_and_read_back() -> None:
    where = Address.parse("telegram:-1001234567890")
    assert where == Address("telegram", "-1001234567890")
    assert where.conversation == str(where) == "telegram:-1001234567890"
    assert Address.parse("web:room:with:colons").chat == "room:with:colons"
    threaded = where.in_thread("42")
    assert (threaded.thread, threaded.conversation) == ("42", "telegram:-1001234567890")


@pytest.mark.parametrize("text", ["", "telegram", ":-100"])
def test_what_is_not_an_address_is_said(text: str) -> None:
    with pytest.raises(AddressError, match="expected '<platform>:<chat>'"):
        Address.parse(text)


def test_an_actor_is_written_and_read_back() -> None:
    actor = Actor.parse("slack:U0123ABCD")
    assert (actor.platform, actor.user, str(actor)) == ("slack", "U0123ABCD", "slack:U0123ABCD")
    assert platform_of("web:alice") == "web"
    assert platform_of("alice") == ""
    with pytest.raises(ActorError):
        Actor.parse("nowhere:1")


def test_an_arrival_a_press_and_a_card_carry_their_address_and_actor() -> None:
    said = Inbound("slack", "C0123ABCD", "1.2", "slack:U0123ABCD", "Ann", "hi", thread="1.1")
    assert (said.where, said.who) == (Address("slack", "C0123ABCD", "1.1"), Actor("slack", "U0123ABCD"))
    pressed = Press("telegram", "kz1:x:a", "telegram:111", chat="-100")
    assert (pressed.where, pressed.who) == (Address("telegram", "-100"), Actor("telegram", "111"))
    assert Press("web", "kz1:x:a", "web:alice").where is None
    assert CardRef("discord", "123", "9").where == Address("discord", "123")
