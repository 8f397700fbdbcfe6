from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kazma.config import ConfigError, DangerLevel, enabled_platforms, load_config, load_config_text, platform_statuses
from kazma.config.registry.telegram import token_problem as telegram_token_problem

REPO = Path(__file__).resolve().parent.parent


def test_committed_default_is_valid_with_no_tokens() -> None:
    loaded = load_config(REPO / "kazma.yaml", environ={})
    assert enabled_platforms(loaded) == []
    reasons = {s.name: s.reason for s in platform_statuses(loaded)}
    assert reasons == {
        "telegram": "token is empty (set TELEGRAM_BOT_TOKEN)",
        "slack": "bot_token is empty (set SLACK_BOT_TOKEN)",
        "discord": "token is empty (set DISCORD_BOT_TOKEN)",
        "matrix": "access_token is empty (set MATRIX_ACCESS_TOKEN)",
    }
    cfg = loaded.config
    assert cfg.pipelines["standard"] == ["researcher", "refiner", "builder", "validator"]
    assert cfg.pipelines["quick"] == ["researcher", "builder"]


def test_empty_file_gives_documented_defaults() -> None:
    cfg = load_config_text("", base_dir=REPO).config  # relative paths start at the file's folder
    committed = load_config(REPO / "kazma.yaml", environ={}).config
    assert cfg.model_dump() == committed.model_dump()  # the settings; each knows the file it came from
    assert (cfg.source, committed.source) == ("kazma.yaml", str(REPO / "kazma.yaml"))


def test_env_substitution_turns_platform_on() -> None:
    text = (REPO / "kazma.yaml").read_text()
    loaded = load_config_text(text, environ={"TELEGRAM_BOT_TOKEN": "123:abc", "KAZMA_MODEL": "qwen"})
    assert loaded.config.platforms.telegram.token == "123:abc"
    assert loaded.config.model.name == "qwen"
    assert enabled_platforms(loaded) == ["telegram"]


def test_default_used_when_variable_empty_and_literal_dollar() -> None:
    text = "model: {name: '${M:-fallback}', api_key: 'pa$$word'}"
    cfg = load_config_text(text, environ={"M": ""}).config
    assert cfg.model.name == "fallback"
    assert cfg.model.api_key == "pa$word"


def test_environment_cannot_change_structure() -> None:
    cfg = load_config_text("model: {name: '${M}'}", environ={"M": "x\nstore: {path: /etc/passwd}"}).config
    assert cfg.model.name == "x\nstore: {path: /etc/passwd}"
    assert str(cfg.store.path) == ".kazma/kazma.db"


def test_numbers_from_environment_are_parsed() -> None:
    text = "platforms: {telegram: {token: t, home_chat: '${CHAT}', chats: ['${CHAT}']}}"
    cfg = load_config_text(text, environ={"CHAT": "-1001234567890"}).config
    assert cfg.platforms.telegram.home_chat == -1001234567890
    assert cfg.platforms.telegram.chats == [-1001234567890]


def test_unlisted_tool_is_dangerous() -> None:
    cfg = load_config_text("tools: {read_file: read}").config
    assert cfg.danger_level("read_file") is DangerLevel.READ
    assert cfg.danger_level("rm_rf") is DangerLevel.DANGEROUS


def test_approvers_include_platform_admins() -> None:
    text = """
approvals: {approvers: ["telegram:1", "web:admin", "slack:U9"]}
platforms: {telegram: {admins: [2]}, discord: {admins: [3]}}
"""
    cfg = load_config_text(text).config
    assert cfg.roster.approvers_for("telegram") == {"telegram:1", "telegram:2"}
    assert cfg.roster.approvers_for("discord") == {"discord:3"}
    assert cfg.roster.approvers_for("web") == {"web:admin"}
    assert cfg.roster.approvers_for("slack") == {"slack:U9"}


def test_slack_base_url_gets_trailing_slash() -> None:
    cfg = load_config_text("platforms: {slack: {api_base_url: 'http://127.0.0.1:9/api'}}").config
    assert cfg.platforms.slack.api_base_url == "http://127.0.0.1:9/api/"


def test_url_schemes_are_read_in_any_case_and_kept_in_lower_case() -> None:
    # A scheme is case-insensitive (RFC 3986): HTTPS://… was refused as "expected an http(s) URL". It is kept in
    # lower case, as everything that compares it (https:// for the proxy warning, secure cookies, passkeys'
    # origin) and every link reads it.
    from kazma.bot.console.passkeys import RelyingParty

    text = """
web: {public_url: 'HTTPS://Kazma.example.org/', trusted_proxies: [127.0.0.1]}
model: {base_url: 'Http://127.0.0.1:11434/v1'}
mcp_servers: {files: {url: 'HTTP://127.0.0.1:9/mcp'}}
platforms: {matrix: {homeserver: 'HTTPS://m.example.org'}, discord: {gateway_url: 'WSS://g.example.org'}}
"""
    cfg = load_config_text(text, platform_secrets=False).config
    assert cfg.web.public_url == "https://Kazma.example.org"
    assert cfg.model.base_url == "http://127.0.0.1:11434/v1"
    assert cfg.mcp_servers["files"].url == "http://127.0.0.1:9/mcp"
    assert cfg.platforms.matrix.homeserver == "https://m.example.org"
    assert cfg.platforms.discord.gateway_url == "wss://g.example.org"
    assert RelyingParty.of(cfg.web.public_url).origin == "https://kazma.example.org"
    with pytest.raises(ConfigError):
        load_config_text("web: {public_url: 'HTTPX://kazma.example.org'}")


# Each malformed configuration must be refused with exactly the problem lines
# given, each naming the key path.
MALFORMED: list[tuple[str, str, dict[str, str], list[str]]] = [
    (
        "bad chat id",
        "platforms: {telegram: {home_chat: general}}",
        {},
        ["kazma.yaml: platforms.telegram.home_chat: expected an integer chat id, got 'general'"],
    ),
    (
        "unknown key",
        "platforms: {telegram: {hom_chat: 1}}",
        {},
        [
            "kazma.yaml: platforms.telegram.hom_chat: unknown key (expected one of: admins, api_base_url, chats, "
            "dm_policy, home_chat, mini_app, mode, token, webhook)"
        ],
    ),
    (
        "unknown top-level key",
        "modle: {name: x}",
        {},
        [
            "kazma.yaml: modle: unknown key (expected one of: agents, api, approvals, audit, files, mcp_servers, "
            "model, models, people, pipelines, platforms, store, swarm, tools, web)"
        ],
    ),
    (
        "unknown key inside a worker",
        "agents: {workers: {researcher: {system_prompt: x, tool: [a]}}}\npipelines: {}",
        {},
        [
            "kazma.yaml: agents.workers.researcher.tool: unknown key (expected one of: expertise, model, "
            "system_prompt, tools)"
        ],
    ),
    (
        "wrong type",
        "web: {port: eighty}",
        {},
        ["kazma.yaml: web.port: expected an integer, got the text 'eighty'"],
    ),
    (
        "port out of range",
        "web: {port: 70000}",
        {},
        ["kazma.yaml: web.port: must be at most 65535, got 70000"],
    ),
    (
        "missing token variable",
        "platforms: {telegram: {token: '${TELEGRAM_BOT_TOKEN}'}}",
        {},
        [
            "kazma.yaml: platforms.telegram.token: environment variable TELEGRAM_BOT_TOKEN is not set "
            "(write ${TELEGRAM_BOT_TOKEN:-} to make it optional)"
        ],
    ),
    (
        "unknown tool level",
        "tools: {shell: danger}",
        {},
        ["kazma.yaml: tools.shell: expected one of read, write, dangerous, got 'danger'"],
    ),
    (
        "pipeline naming an unknown worker",
        "pipelines: {quick: [researcher, bilder]}",
        {},
        ["kazma.yaml: pipelines.quick[1]: unknown worker 'bilder' (workers: builder, refiner, researcher, validator)"],
    ),
    (
        "negative deadline",
        "approvals: {deadline_seconds: -5}",
        {},
        ["kazma.yaml: approvals.deadline_seconds: must be greater than 0, got -5"],
    ),
    (
        "unreadable YAML",
        "store:\n  path: [unclosed\n",
        {},
        ["kazma.yaml: line 3, column 1: invalid YAML: expected ',' or ']', but got '<stream end>'"],
    ),
    (
        "duplicate key",
        "web: {port: 1}\nweb: {port: 2}\n",
        {},
        ["kazma.yaml: line 2, column 1: invalid YAML: duplicate key 'web'"],
    ),
    (
        # pydantic read true as 1: a one-second deadline, one worker, without a word
        "true for a number",
        "approvals: {deadline_seconds: true}\nswarm: {max_parallel: false}\n",
        {},
        [
            "kazma.yaml: approvals.deadline_seconds: expected a number, got true",
            "kazma.yaml: swarm.max_parallel: expected a number, got false",
        ],
    ),
    (
        "true for a number in the audit sink",
        "audit: {sink: {file: audit.jsonl, timeout_seconds: yes}}",
        {},
        ["kazma.yaml: audit.sink.timeout_seconds: expected a number, got true"],
    ),
    (
        "true for a number in a list of numbers",  # read as 1: a pause after stage 1
        "agents: {workers: {a: {system_prompt: x}, b: {system_prompt: y}}}\npipelines: {p: [a, b]}\n"
        "swarm: {checkpoints: {p: [true]}}\n",
        {},
        ["kazma.yaml: swarm.checkpoints.p[0]: expected a number, got true"],
    ),
    (
        "a list as a key",  # a traceback: the list is unhashable
        "? [web]\n: 1\n",
        {},
        ["kazma.yaml: line 1, column 3: invalid YAML: a key must be a name, got a list"],
    ),
    (
        # nine aliases of nine aliases, eight levels: minutes of CPU and gigabytes once expanded
        "an alias bomb",
        "a: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n"
            for prev, name in zip("abcdefg", "bcdefgh", strict=True)
        ),
        {},
        ["kazma.yaml: line 6, column 4: invalid YAML: holds more than 100000 values once its aliases are expanded"],
    ),
    (
        # psycopg refused it only when a command opened the store: a traceback, or doctor quoting the password
        "a PostgreSQL password with a bad percent escape",
        "store: {url: 'postgresql://kazma:hunter2%zz@db/kazma'}",
        {},
        ["kazma.yaml: store.url: not a PostgreSQL URL libpq can read: invalid percent-encoded token"],
    ),
    (
        "a PostgreSQL URL with an unclosed IPv6 bracket",
        "store: {url: 'postgresql://kazma:hunter2@[::1/kazma'}",
        {},
        [
            "kazma.yaml: store.url: not a PostgreSQL URL libpq can read: end of string reached when looking for "
            'matching "]" in IPv6 host address in URI'
        ],
    ),
    (
        "a list that holds itself",  # a RecursionError traceback
        "web: &w [*w]\n",
        {},
        ["kazma.yaml: line 1, column 6: invalid YAML: an alias refers to a value that holds it"],
    ),
    (
        "nested too deep",
        "web: " + "[" * 100 + "]" * 100 + "\n",
        {},
        ["kazma.yaml: line 1, column 70: invalid YAML: nested more than 64 levels deep"],
    ),
    (
        "a number too long to read",  # a ValueError traceback from int()
        "web: {port: " + "1" * 5000 + "}\n",
        {},
        ["kazma.yaml: line 1, column 13: invalid YAML: a number of 5000 characters is too long"],
    ),
    (
        "a set as a key",  # a traceback: the set is unhashable too (YAML's !!set tag, which SafeLoader builds)
        "platforms:\n  ? !!set {web: null}\n  : 1\n",
        {},
        ["kazma.yaml: line 2, column 5: invalid YAML: a key must be a name, got a set"],
    ),
    (
        "a NUL in a path and a token",  # "value error, embedded null byte", at no key
        'tools: {workspace_root: "ws\\0x"}\nplatforms: {telegram: {token: "12:\\0"}}\n',
        {},
        [
            "kazma.yaml: tools.workspace_root: may not contain a NUL character (\\0)",
            "kazma.yaml: platforms.telegram.token: may not contain a NUL character (\\0)",
        ],
    ),
    (
        "top level is a list",
        "- a\n- b\n",
        {},
        ["kazma.yaml: expected a mapping of settings at the top, got a list"],
    ),
    (
        "approver without platform",
        "approvals: {approvers: ['111']}",
        {},
        [
            "kazma.yaml: approvals.approvers[0]: expected '<platform>:<user id>' (platform one of telegram, "
            "slack, discord, matrix, web, cli) or a person or group under people:, got '111'"
        ],
    ),
    (
        "slack HTTP mode without signing secret",
        "platforms: {slack: {bot_token: xoxb-1}}",
        {},
        ["kazma.yaml: platforms.slack.signing_secret: required for HTTP events (or set app_token to use Socket Mode)"],
    ),
    (
        "bad slack channel",
        "platforms: {slack: {home_channel: general}}",
        {},
        ["kazma.yaml: platforms.slack.home_channel: expected a Slack channel id like C0123456789, got 'general'"],
    ),
    (
        "discord id is text",
        "platforms: {discord: {admins: ['12ab']}}",
        {},
        ["kazma.yaml: platforms.discord.admins[0]: expected a numeric Discord id, got '12ab'"],
    ),
    (
        "an admin named as nobody under people:",
        "platforms: {discord: {admins: [me]}}",
        {},
        ["kazma.yaml: platforms.discord.admins[0]: unknown person or group 'me' (people: none configured)"],
    ),
    (
        "bad mode literal",
        "platforms: {telegram: {mode: push}}",
        {},
        ["kazma.yaml: platforms.telegram.mode: expected one of 'polling' or 'webhook', got 'push'"],
    ),
    (
        "webhook without secret",
        "platforms: {telegram: {token: t, mode: webhook, webhook: {url: 'https://x.example/tg'}}}",
        {},
        ["kazma.yaml: platforms.telegram.webhook.secret_token: required when mode is 'webhook'"],
    ),
    (
        "section is not a mapping",
        "store: .kazma/db",
        {},
        ["kazma.yaml: store: expected a mapping, got the text '.kazma/db'"],
    ),
    (
        "boolean where a chat id belongs",
        "platforms: {telegram: {chats: [true]}}",
        {},
        ["kazma.yaml: platforms.telegram.chats[0]: expected an integer chat id or '*' for every chat, got True"],
    ),
    (
        "lead shares a worker's name",
        "agents: {lead: {name: builder}}",
        {},
        ["kazma.yaml: agents.lead.name: the lead agent's name 'builder' is also a worker's name"],
    ),
    (
        "worker named auto",
        "agents: {workers: {auto: {system_prompt: x}}}\npipelines: {}",
        {},
        ["kazma.yaml: agents.workers.auto: 'auto' is reserved: /swarm dispatch auto picks a worker"],
    ),
    (
        "two problems, two lines",
        "web: {port: -1}\nswarm: {max_parallel: 1001}",
        {},
        [
            "kazma.yaml: web.port: must be at least 0, got -1",
            "kazma.yaml: swarm.max_parallel: must be at most 1000, got 1001",
        ],
    ),
    (
        # a section or key left with nothing under it is YAML's null: it was "got NoneType None"
        "empty section and value",
        "web:\nmodel:\n  name:\n",
        {},
        [
            "kazma.yaml: web: expected a mapping, got nothing (the key has no value: give it one, or remove the key)",
            "kazma.yaml: model.name: expected text, got nothing (the key has no value: give it one, or remove the key)",
        ],
    ),
]


@pytest.mark.parametrize(("text", "environ", "expected"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_configuration_is_refused_with_its_path(
    text: str, environ: dict[str, str], expected: list[str]
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config_text(text, environ=environ)
    assert caught.value.lines == expected
    assert all("\n" not in line for line in caught.value.lines)


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(binary)


def test_yaml_nested_deeper_than_the_parser_recurses_is_refused_with_its_line() -> None:
    # PyYAML's composer recurses once per level: a thousand levels was a RecursionError traceback. Where it gave
    # out depends on the stack the test runs on, so only the line is pinned.
    with pytest.raises(ConfigError) as caught:
        load_config_text("web: " + "[" * 1000 + "]" * 1000 + "\n")
    [line] = caught.value.lines
    assert line.startswith("kazma.yaml: line 1, column ")
    assert line.endswith(": invalid YAML: nested more than 64 levels deep")


def test_an_empty_kazma_config_variable_means_the_default_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `KAZMA_CONFIG=` (compose's `${KAZMA_CONFIG:-}`) named "." and every command said ".: is a directory".
    (tmp_path / "kazma.yaml").write_text("web: {port: 9001}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KAZMA_CONFIG", "")
    loaded = load_config()
    assert loaded.source == Path("kazma.yaml")
    assert loaded.config.web.port == 9001


def test_yaml_merge_keys_share_settings_and_a_key_written_twice_is_still_refused() -> None:
    # `<<: *a` was "could not determine a constructor for the tag 'tag:yaml.org,2002:merge'"
    loaded = load_config_text(
        "agents:\n"
        "  workers:\n"
        "    a: &shared {system_prompt: A, tools: [read_file], expertise: [x]}\n"
        "    b:\n"
        "      <<: *shared\n"
        "      system_prompt: B\n"  # the mapping's own key overrides the merged one
        "      expertise: [y]\n"
        "pipelines: {}\n"
        "web: {<<: [{port: 9001}, {port: 9002, host: 127.0.0.2}]}\n"  # the earlier mapping wins
    )
    b = loaded.config.agents.workers["b"]
    assert (b.system_prompt, b.tools, b.expertise) == ("B", ["read_file"], ["y"])
    assert (loaded.config.web.port, loaded.config.web.host) == (9001, "127.0.0.2")
    with pytest.raises(ConfigError) as caught:
        load_config_text("web: &w {port: 1}\napi: {<<: *w, port: 2, port: 3}\n")
    assert caught.value.lines == ["kazma.yaml: line 2, column 24: invalid YAML: duplicate key 'port'"]
    with pytest.raises(ConfigError) as caught:
        load_config_text("web: {<<: 1}\n")
    assert caught.value.lines == [
        "kazma.yaml: line 1, column 11: invalid YAML: expected a mapping or list of mappings for merging, "
        "but found scalar"
    ]


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("mcp_servers: {s: {url: 'http://mcp.test/', headers: {Authorization: 'Bearer s3cr3t-t0ken'}}}\n", "headers"),
        ("mcp_servers: {s: {command: srv, env: ['s3cr3t-t0ken']}}\n", "env[0]"),
    ],
)
def test_a_secret_written_where_a_variable_name_belongs_is_not_repeated(text: str, where: str) -> None:
    # The error line goes to the terminal, CI logs and doctor's report: it echoed 'Bearer s3cr3t-t0ken'.
    with pytest.raises(ConfigError) as caught:
        load_config_text(text)
    [line] = caught.value.lines
    assert line.startswith(f"kazma.yaml: mcp_servers.s.{where}")
    assert "expected the name of an environment variable" in line
    assert "s3cr3t" not in line


@pytest.mark.parametrize("pasted", ["\n", "\r\n", "  \n\n", "\t"])
def test_a_secret_read_with_a_trailing_line_break_is_trimmed_and_said(pasted: str) -> None:
    """A token in the environment read from a file with its newline (a Kubernetes secret, `export T="$(<f)"` with a
    blank line) loaded as is: kazma run then met "invalid token" from the platform, while doctor said "contains a
    line break". The trailing white space is dropped at load, with a warning naming the key and the variable."""
    token = "123456789:AAE" + "x" * 30
    text = "platforms: {telegram: {token: '${TELEGRAM_BOT_TOKEN}', home_chat: -1001}}\n"
    with capture_logs() as logged:
        loaded = load_config_text(text, environ={"TELEGRAM_BOT_TOKEN": token + pasted})
    assert loaded.config.platforms.telegram.token == token
    assert telegram_token_problem(loaded.config.platforms.telegram.token) is None  # what doctor judges
    trimmed = [e for e in logged if e["event"] == "config.env_value_trimmed"]
    assert trimmed == [
        {
            "event": "config.env_value_trimmed",
            "key": "platforms.telegram.token",
            "variable": "TELEGRAM_BOT_TOKEN",
            "log_level": "warning",
        }
    ]
    assert token not in repr(logged)


def test_only_trailing_white_space_of_a_whole_value_is_trimmed() -> None:
    """White space inside a token is a paste gone wrong that only a person can fix: kept, for doctor to name; a
    variable within a longer text is that text's own affair."""
    text = "platforms: {telegram: {token: '${T}', home_chat: -1001}}\nagents: {lead: {system_prompt: 'Hi ${P}'}}\n"
    with capture_logs() as logged:
        loaded = load_config_text(text, environ={"T": "123456789:AAE xx\n", "P": "there\n"})
    assert loaded.config.platforms.telegram.token == "123456789:AAE xx"
    assert loaded.config.agents.lead.system_prompt == "Hi there\n"
    assert telegram_token_problem(loaded.config.platforms.telegram.token) == (
        "contains spaces or a line break: copy it again, without anything around it"
    )
    assert [e["variable"] for e in logged if e["event"] == "config.env_value_trimmed"] == ["T"]
