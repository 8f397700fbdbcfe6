"""Matrix in the configuration: ids with colons in them, the people roster, the token's shape and redaction,
and ``kazma init`` writing a section that loads."""

from __future__ import annotations

import pytest

from kazma.bot.cli.init_config import InitAnswers, Presence, render
from kazma.bot.logging import redact, redact_config_secrets
from kazma.config import load_config_text
from kazma.config.errors import ConfigError
from kazma.config.registry import CHAT_PLATFORMS, chat_id_problem, user_id_problem
from kazma.config.registry.matrix import access_token_problem

ROOM = "!AbCdEf123:example.org"
ALICE = "@alice:example.org"


def matrix_yaml(extra: str = "", **section: str) -> str:
    values = {"homeserver": "https://matrix.example.org", "access_token": "syt_a2F6bWE_secretsecret_0abc",
              "home_room": f"'{ROOM}'", "admins": f"['{ALICE}']", **section}  # fmt: skip
    body = "".join(f"    {key}: {value}\n" for key, value in values.items())
    return f"{extra}platforms:\n  matrix:\n{body}"


def test_a_person_on_matrix_is_an_approver_by_their_user_id_with_its_colons() -> None:
    text = (
        "people:\n  bob:\n    matrix: '@bob:example.org'\napprovals: {approvers: [bob, 'matrix:@carol:example.org']}\n"
    )
    config = load_config_text(matrix_yaml(text), environ={}).config
    approvers = config.roster.approvers_for("matrix")
    assert {"matrix:@bob:example.org", "matrix:@carol:example.org", f"matrix:{ALICE}"} <= approvers
    assert config.roster.is_approver("matrix:@bob:example.org", "matrix")
    assert not config.roster.is_approver("matrix:@bob:evil.example", "matrix")


@pytest.mark.parametrize(
    ("yaml", "where"),
    [
        (matrix_yaml(admins="['alice']"), "platforms.matrix.admins[0]"),
        (matrix_yaml(home_room="'#general:example.org'"), "platforms.matrix.home_room"),
        (matrix_yaml(homeserver="''"), "platforms.matrix.homeserver"),
        ("people:\n  bob:\n    matrix: 'bob'\n", "people.bob.matrix"),
    ],
)
def test_malformed_matrix_settings_are_refused_with_their_path(yaml: str, where: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config_text(yaml, environ={})
    assert any(where in line for line in caught.value.lines), caught.value.lines


def test_ids_and_the_tokens_usual_mix_ups() -> None:
    assert user_id_problem("matrix", ALICE) is None
    assert user_id_problem("matrix", "alice") == CHAT_PLATFORMS["matrix"].user_id_hint
    assert chat_id_problem("matrix", ROOM) is None
    assert chat_id_problem("matrix", "!opaqueRoomV12id") is None  # room version 12 ids carry no server
    assert chat_id_problem("matrix", "#alias:example.org") is not None
    assert access_token_problem("syt_a2F6bWE_abc_123") is None
    assert "Bearer" in str(access_token_problem("Bearer syt_abc"))
    assert "homeserver" in str(access_token_problem("https://matrix.example.org"))
    assert "Matrix id" in str(access_token_problem(ALICE))


def test_the_access_token_never_reaches_a_log_line() -> None:
    config = load_config_text(matrix_yaml(access_token="mysterious-opaque-token-1"), environ={}).config
    redact_config_secrets(config)
    assert "mysterious-opaque-token-1" not in redact("GET /sync with mysterious-opaque-token-1")
    # a Synapse-shaped token in a URL a library logs, even one Kazma was never given
    line = redact("GET https://hs/_matrix/media/v3/download/x?access_token=syt_b3RoZXI_QmFzZTY0_1a2b3c")
    assert "syt_b3RoZXI" not in line


def test_kazma_init_writes_a_matrix_section_that_loads() -> None:
    answers = InitAnswers("ops", matrix=Presence(ALICE, ROOM))
    assert answers.secrets == ["MATRIX_ACCESS_TOKEN", "MATRIX_HOMESERVER"]  # what `kazma init` says to export
    text = render(answers)
    assert "${MATRIX_ACCESS_TOKEN}" in text
    assert "${MATRIX_HOMESERVER}" in text
    environ = {"MATRIX_ACCESS_TOKEN": "syt_placeholder", "MATRIX_HOMESERVER": "https://matrix.example.org"}
    section = load_config_text(text, environ=environ).config.platforms.matrix
    assert (section.homeserver, section.home_room, section.admins) == ("https://matrix.example.org", ROOM, [ALICE])
