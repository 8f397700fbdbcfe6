"""What a person sees is what runs: hidden characters are escaped and named, look-alikes flagged, the call unchanged."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import unicodedata
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kazma.adapters.card_layout import ButtonKind, CardWriter, PlainWriter, lay_out, view_of
from kazma.adapters.discord.render import DiscordWriter
from kazma.adapters.slack.render import SlackWriter
from kazma.adapters.telegram.render import TelegramWriter
from kazma.adapters.web.render import HtmlWriter
from kazma.approvals import (
    ApprovalCard,
    Hidden,
    LookAlikeKind,
    Status,
    args_hash,
    build_card,
    canonical_json,
    examine,
    examine_line,
    reveal,
    reveal_line,
    unreveal,
    unreveal_line,
    warnings_for,
)
from kazma.approvals.card import render_value
from kazma.approvals.honesty import (
    ESCAPE_OPEN,
    MAX_ESCAPE_LENGTH,
    classify,
    escape,
    escape_spans,
    padding_gaps,
    safe_prefix,
    safe_suffix,
)
from kazma.approvals.model import ApprovalRequest
from tests.contract.harness import make_card


def request_for(args: dict[str, Any], tool: str = "shell") -> ApprovalRequest:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    return ApprovalRequest(
        id="AbCdEfGhIjKlMnOpQrStUvWx",
        tool=tool,
        args=args,
        args_json=canonical_json(args),
        args_hash=args_hash(args),
        requested_by="agent:builder",
        conversation="telegram:-100",
        created_at=now,
        deadline=now,
        status=Status.PENDING,
    )


def card_for(value: str, *, limit: int = 4000) -> tuple[ApprovalRequest, ApprovalCard]:
    request = request_for({"command": value})
    return request, build_card(request, value_limit=limit, public_url="http://x.test")


def assert_runs_unchanged(request: ApprovalRequest, card: ApprovalCard, value: str) -> None:
    """The argument that would run is byte for byte the value, and the card's hash is the SHA-256 of that call."""
    runs = json.loads(request.args_json)["command"]
    assert runs.encode("utf-8") == value.encode("utf-8")
    assert card.args_hash == hashlib.sha256(canonical_json({"command": value}).encode("utf-8")).hexdigest()
    (arg,) = card.arguments
    assert not arg.cut
    assert unreveal(arg.head) == value  # what is shown decodes to exactly what runs
    assert arg.value_length == len(value)


CASES = [
    # (value, the character, its class, the escape that must be shown)
    ("echo hi; true \u202e # ; rm -rf ~", "\u202e", Hidden.BIDI, "\u27e8U+202E RLO\u27e9"),
    ("echo hi; true \u2067# ;\u2069 rm -rf ~", "\u2067", Hidden.BIDI, "\u27e8U+2067 RLI\u27e9"),
    ("a\u202ab", "\u202a", Hidden.BIDI, "\u27e8U+202A LRE\u27e9"),
    ("a\u202bb", "\u202b", Hidden.BIDI, "\u27e8U+202B RLE\u27e9"),
    ("a\u202cb", "\u202c", Hidden.BIDI, "\u27e8U+202C PDF\u27e9"),
    ("a\u202db", "\u202d", Hidden.BIDI, "\u27e8U+202D LRO\u27e9"),
    ("a\u2066b", "\u2066", Hidden.BIDI, "\u27e8U+2066 LRI\u27e9"),
    ("a\u2068b", "\u2068", Hidden.BIDI, "\u27e8U+2068 FSI\u27e9"),
    ("a\u2069b", "\u2069", Hidden.BIDI, "\u27e8U+2069 PDI\u27e9"),
    ("a\u200eb", "\u200e", Hidden.BIDI, "\u27e8U+200E LRM\u27e9"),
    ("a\u200fb", "\u200f", Hidden.BIDI, "\u27e8U+200F RLM\u27e9"),
    ("a\u061cb", "\u061c", Hidden.BIDI, "\u27e8U+061C ALM\u27e9"),
    ("rm -rf /tmp/build\u200b ~", "\u200b", Hidden.ZERO_WIDTH, "\u27e8U+200B ZWSP\u27e9"),
    ("git\u200cclone", "\u200c", Hidden.ZERO_WIDTH, "\u27e8U+200C ZWNJ\u27e9"),
    ("git\u200dclone", "\u200d", Hidden.ZERO_WIDTH, "\u27e8U+200D ZWJ\u27e9"),
    ("git\u2060clone", "\u2060", Hidden.ZERO_WIDTH, "\u27e8U+2060 WJ\u27e9"),
    ("\ufeffcurl x | sh", "\ufeff", Hidden.ZERO_WIDTH, "\u27e8U+FEFF BOM\u27e9"),
    ("pass\u00adwd", "\u00ad", Hidden.FORMAT, "\u27e8U+00AD SHY\u27e9"),
    ("f\u2061(x)", "\u2061", Hidden.FORMAT, "\u27e8U+2061\u27e9"),
    ("x\u206ay", "\u206a", Hidden.FORMAT, "\u27e8U+206A\u27e9"),
    ("ok\U000e0072\U000e006d", "\U000e0072", Hidden.TAG, "\u27e8U+E0072 TAG r\u27e9"),
    ("ok\U000e0001", "\U000e0001", Hidden.TAG, "\u27e8U+E0001 LANG\u27e9"),
    ("ok\U000e007f", "\U000e007f", Hidden.TAG, "\u27e8U+E007F CANCEL\u27e9"),
    ("rm -rf ~\recho safe", "\r", Hidden.CONTROL, "\u27e8U+000D CR\u27e9"),
    ("rm -rf ~\x1b[2K\x1b[1Gecho safe", "\x1b", Hidden.CONTROL, "\u27e8U+001B ESC\u27e9[2K"),
    ("a\x00b", "\x00", Hidden.CONTROL, "\u27e8U+0000 NUL\u27e9"),
    ("a\x08b", "\x08", Hidden.CONTROL, "\u27e8U+0008 BS\u27e9"),
    ("a\x0bb", "\x0b", Hidden.CONTROL, "\u27e8U+000B VT\u27e9"),
    ("a\x7fb", "\x7f", Hidden.CONTROL, "\u27e8U+007F DEL\u27e9"),
    ("a\x85b", "\x85", Hidden.CONTROL, "\u27e8U+0085 NEL\u27e9"),
    ("a\x9b2Kb", "\x9b", Hidden.CONTROL, "\u27e8U+009B CSI\u27e9"),
    ("echo ok\u2028rm -rf ~", "\u2028", Hidden.SEPARATOR, "\u27e8U+2028 LS\u27e9"),
    ("echo ok\u2029rm -rf ~", "\u2029", Hidden.SEPARATOR, "\u27e8U+2029 PS\u27e9"),
    ("ok\ufe0f", "\ufe0f", Hidden.VARIATION, "\u27e8U+FE0F VS16\u27e9"),
    ("ok\U000e0100", "\U000e0100", Hidden.VARIATION, "\u27e8U+E0100 VS17\u27e9"),
    ("ok\u180b", "\u180b", Hidden.VARIATION, "\u27e8U+180B\u27e9"),
    ("cat \u3164 x", "\u3164", Hidden.FILLER, "\u27e8U+3164\u27e9"),
    ("cat \u115f x", "\u115f", Hidden.FILLER, "\u27e8U+115F\u27e9"),
    ("cat \u1160 x", "\u1160", Hidden.FILLER, "\u27e8U+1160\u27e9"),
    ("cat \u2800 x", "\u2800", Hidden.FILLER, "\u27e8U+2800\u27e9"),
    ("git\u200ahub", "\u200a", Hidden.SPACE, "\u27e8U+200A\u27e9"),
    ("rm\u00a0-rf ~", "\u00a0", Hidden.SPACE, "\u27e8U+00A0 NBSP\u27e9"),
    ("rm -rf\u202f~", "\u202f", Hidden.SPACE, "\u27e8U+202F NNBSP\u27e9"),
    ("rm -rf\u3000~", "\u3000", Hidden.SPACE, "\u27e8U+3000\u27e9"),
    ("rm -rf\u1680~", "\u1680", Hidden.SPACE, "\u27e8U+1680\u27e9"),
    ("x\ue000y", "\ue000", Hidden.UNKNOWN, "\u27e8U+E000\u27e9"),
    ("x\u0378y", "\u0378", Hidden.UNKNOWN, "\u27e8U+0378\u27e9"),
    ("x \u27e8U+202E RLO\u27e9", "\u27e8", Hidden.BRACKET, "\u27e8U+27E8\u27e9U+202E RLO\u27e9"),
    ("x \u3008U+202E\u3009", "\u3008", Hidden.BRACKET, "\u27e8U+3008\u27e9U+202E"),
]


@pytest.mark.parametrize(("value", "char", "kind", "shown"), CASES, ids=[f"U+{ord(c[1]):04X}" for c in CASES])
def test_each_class_is_escaped_named_and_runs_unchanged(value: str, char: str, kind: Hidden, shown: str) -> None:
    request, card = card_for(value)
    (arg,) = card.arguments
    assert shown in arg.head
    # The character itself is gone; ⟨ remains only as the start of real escapes.
    assert char not in arg.head or (char == ESCAPE_OPEN and arg.head.count(char) == len(escape_spans(arg.head)))
    assert kind in arg.findings.kinds
    finding = next(h for h in arg.findings.hidden if h.kind is kind)
    assert ord(char) in {c.code_point for c in finding.code_points}
    assert card.has_warnings
    assert any(kind.label in w and "argument 'command'" in w for w in card.warnings), card.warnings
    assert f"U+{ord(char):04X}" in " ".join(card.warnings)
    assert_runs_unchanged(request, card, value)


def test_the_trojan_source_command_reads_differently_once_escaped() -> None:
    value = "echo hi; true \u202e # ; ~ fr- mr\u202c"
    request, card = card_for(value)
    (arg,) = card.arguments
    assert arg.head == "echo hi; true \u27e8U+202E RLO\u27e9 # ; ~ fr- mr\u27e8U+202C PDF\u27e9"
    assert card.warnings[0].startswith("Hidden or control characters in argument 'command': direction controls (")
    assert "1 \u00d7 U+202E RLO" in card.warnings[0]
    assert_runs_unchanged(request, card, value)


def test_every_c0_and_c1_control_but_newline_is_escaped() -> None:
    for code_point in [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)]:
        shown = reveal(f"a{chr(code_point)}b")
        if code_point == 0x0A:
            assert shown == "a\nb"
        else:
            assert shown == f"a{escape(code_point)}b"
            assert len(escape(code_point)) <= MAX_ESCAPE_LENGTH


def test_newline_stays_a_newline_and_tab_is_escaped_without_a_warning() -> None:
    value = "all:\n\tmake build\nclean:\n\trm -rf out"
    request, card = card_for(value)
    (arg,) = card.arguments
    assert arg.head == "all:\n\u27e8U+0009 TAB\u27e9make build\nclean:\n\u27e8U+0009 TAB\u27e9rm -rf out"
    assert arg.findings.kinds == {Hidden.TAB}
    assert arg.findings.hidden[0].count == 2
    assert not arg.findings.warns
    assert not arg.flagged
    assert card.warnings == ()
    assert_runs_unchanged(request, card, value)


@pytest.mark.parametrize(
    ("value", "kind", "word", "phrase", "foreign"),
    [
        (
            "git clone https://g\u0456thub.com/x/y",
            LookAlikeKind.MIXED,
            "g\u0456thub.com",
            "mixes Latin with Cyrillic",
            0x0456,
        ),
        (
            "curl https://p\u0430yp\u0430l.com",
            LookAlikeKind.MIXED,
            "p\u0430yp\u0430l.com",
            "mixes Latin with Cyrillic",
            0x0430,
        ),
        ("http://\u03bfpenai.com", LookAlikeKind.MIXED, "\u03bfpenai.com", "mixes Latin with Greek", 0x03BF),
        ("ssh \u0570ost.example", LookAlikeKind.MIXED, "\u0570ost.example", "mixes Latin with Armenian", 0x0570),
        ("ssh h\u13a1st.example", LookAlikeKind.MIXED, "h\u13a1st.example", "mixes Latin with Cherokee", 0x13A1),
        (
            "http://\u0430\u0440\u0440\u04cf\u0435.com",
            LookAlikeKind.WHOLE,
            "\u0430\u0440\u0440\u04cf\u0435.com",
            "Cyrillic part",
            0x04CF,
        ),
        ("http://\uff47ithub.com", LookAlikeKind.COMPAT, "\uff47ithub.com", "fullwidth or compatibility", 0xFF47),
        ("cat \ufb01le.txt", LookAlikeKind.COMPAT, "\ufb01le.txt", "fullwidth or compatibility", 0xFB01),
        ("kill -9 \u212aernel", LookAlikeKind.COMPAT, "\u212aernel", "fullwidth or compatibility", 0x212A),
        # Latin-only look-alikes: one script, so no mixed-script rule sees them; Unicode's confusables data does.
        ("git clone https://\u0261ithub.com/x", LookAlikeKind.LATIN, "\u0261ithub.com", "for g", 0x0261),
        ("git clone https://g\u0131thub.com/x", LookAlikeKind.LATIN, "g\u0131thub.com", "for i", 0x0131),
        ("git clone https://g\u026athub.com/x", LookAlikeKind.LATIN, "g\u026athub.com", "for i", 0x026A),
        # A whole host label in Cherokee letters that read as Latin ones (ᎪᏴᏟ.com reads ABC.com).
        ("curl https://\u13aa\u13f4\u13df.com", LookAlikeKind.WHOLE, "\u13aa\u13f4\u13df.com", "Cherokee part", 0x13AA),
    ],
)
def test_lookalike_words_are_flagged_with_their_foreign_characters(
    value: str, kind: LookAlikeKind, word: str, phrase: str, foreign: int
) -> None:
    request, card = card_for(value)
    (arg,) = card.arguments
    (found,) = arg.findings.lookalikes
    assert (found.kind, found.word) == (kind, word)
    assert foreign in found.foreign
    assert arg.head == value  # letters are shown as themselves; the warning says what they are
    (warning,) = card.warnings
    assert warning.startswith("Look-alike characters in argument 'command': ")
    assert f"'{word}'" in warning
    assert phrase in warning
    assert f"{chr(foreign)} U+{foreign:04X}" in warning
    assert_runs_unchanged(request, card, value)


def test_the_github_example_reads_as_in_the_brief() -> None:
    (warning,) = warnings_for(examine("g\u0456thub.com"), "argument 'url'")
    expected = "Look-alike characters in argument 'url': 'g\u0456thub.com' mixes Latin with Cyrillic (\u0456 U+0456)."
    assert warning == expected


@pytest.mark.parametrize(
    "sentence",
    [
        "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u042d\u0442\u043e \u0442\u0435\u0441\u0442 \u2014 "
        "\u0432\u0441\u0451 \u0445\u043e\u0440\u043e\u0448\u043e.",  # Привет, мир! Это тест — всё хорошо.
        "\u6771\u4eac\u306f\u6674\u308c\u3067\u3059\u3002\u30c6\u30b9\u30c8\u3092\u5b9f\u884c\u3057\u307e\u3059\u3002"
        "\uff12\uff10\uff12\uff16\u5e74",  # 東京は晴れです。テストを実行します。２０２６年
        "T\u30b7\u30e3\u30c4\u3068A\u80a1",  # Tシャツと A股: Latin beside kana and kanji is ordinary
        "\u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 \u03ba\u03cc\u03c3\u03bc\u03b5",  # Καλημέρα κόσμε
        "\u041c\u043e\u0441\u043a\u0432\u0430.txt und Stra\u00dfe, 5\u00b5m, \u00aa",
        "ls ~/\u0434\u043e\u043a\u0443\u043c\u0435\u043d\u0442\u044b && echo \u0433\u043e\u0442\u043e\u0432\u043e",
        "\u00e7al\u0131\u015ft\u0131r caf\u00e9 na\u00efve \u00e6sir",  # çalıştır: ı beside ç, ş reads as no ASCII word
        "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd 2026",  # a Hebrew line, digits only beside it
    ],
)
def test_ordinary_text_in_one_script_per_word_is_not_flagged(sentence: str) -> None:
    request, card = card_for(sentence)
    (arg,) = card.arguments
    assert arg.findings.empty
    assert arg.head == sentence
    assert card.warnings == ()
    assert_runs_unchanged(request, card, sentence)


def test_hidden_characters_in_a_cut_part_are_still_warned_about() -> None:
    value = "echo start; " + "x" * 5000 + "\u202e middle \u202c" + "y" * 5000 + "; echo end"
    request, card = card_for(value, limit=200)
    (arg,) = card.arguments
    assert arg.cut
    assert "\u27e8U+202E" not in arg.head + arg.tail  # the cut hides it…
    assert arg.findings.kinds == {Hidden.BIDI}  # …the findings do not
    assert any("direction controls" in w for w in card.warnings)
    assert json.loads(request.args_json)["command"] == value


def test_findings_lists_are_bounded() -> None:
    text = "".join(chr(cp) for cp in range(0x202A, 0x202F)) * 50 + " ".join(f"g\u0456thub{i}.com" for i in range(20))
    findings = examine(text)
    (bidi,) = findings.hidden
    assert (bidi.count, bidi.distinct, len(bidi.code_points)) == (250, 5, 3)
    assert len(findings.lookalikes) == 3
    assert findings.lookalike_words == 20
    hidden, lookalike = warnings_for(findings, "x")
    assert ", \u2026)" in hidden
    assert lookalike.endswith("; and 17 more words.")


def test_escape_names_are_short_and_unambiguous() -> None:
    special = [
        *range(0x00, 0x20),
        *range(0x7F, 0xA0),
        *range(0xE0000, 0xE0080),
        *range(0xE0100, 0xE01F0),
        *range(0xFE00, 0xFE10),
        0x10FFFF,
        0x202E,
    ]
    for code_point in special:
        shown = escape(code_point)
        assert len(shown) <= MAX_ESCAPE_LENGTH, shown
        assert shown.count(ESCAPE_OPEN) == 1
        assert shown.count("\u27e9") == 1
        assert shown.startswith(f"\u27e8U+{code_point:04X}")


# -- properties ----------------------------------------------------------------------------------------------

# Text biased towards the characters that matter here, including pieces of the escape notation itself.
tricky = st.sampled_from(
    [
        "\u27e8",
        "\u27e9",
        "\u3008",
        "U+",
        "202E",
        " RLO",
        "\u202e",
        "\u2066",
        "\u200b",
        "\r",
        "\x1b",
        "\t",
        "\n",
        "\x85",
        "\u2028",
        "\ufe0f",
        "\U000e0041",
        "\u3164",
        "\u0456",
        "g",
        "a",
        " ",
        ".",
    ]
)
# Lone surrogates are refused before any card is built (check_arguments), so a card never meets one.
tricky_text = st.lists(tricky | st.characters(exclude_categories=["Cs"]), max_size=60).map("".join)
any_text = st.text(max_size=200) | tricky_text


def dangerous(ch: str) -> bool:
    """Anything reveal must escape, except the escape's own bracket that starts each escape."""
    return classify(ch) is not None and ch != ESCAPE_OPEN


@settings(max_examples=500, deadline=None)
@given(text=any_text)
def test_shown_text_holds_no_hidden_character_and_decodes_to_the_value(text: str) -> None:
    shown = reveal(text)
    assert not any(dangerous(ch) for ch in shown)
    assert unreveal(shown) == text
    # Every ⟨ in shown text starts an escape that reveal makes.
    assert shown.count(ESCAPE_OPEN) == len(escape_spans(shown))
    assert all(classify(unreveal(shown[a:b])) is not None for a, b in escape_spans(shown))


@settings(max_examples=500, deadline=None)
@given(first=tricky_text, second=tricky_text)
def test_distinct_values_never_show_the_same(first: str, second: str) -> None:
    if first != second:
        assert reveal(first) != reveal(second)


@pytest.mark.parametrize(
    ("real", "forged"),
    [
        ("a\u202eb", "a\u27e8U+202E RLO\u27e9b"),
        ("a\u202eb", "a\u3008U+202E RLO\u3009b"),
        ("a\u202eb", "a\u2329U+202E RLO\u232ab"),
        ("a\rb", "a\u27e8U+000D CR\u27e9b"),
    ],
)
def test_a_value_cannot_forge_an_escape(real: str, forged: str) -> None:
    assert reveal(real) != reveal(forged)
    assert not examine(forged).empty  # the forgery is itself flagged
    assert unreveal(reveal(forged)) == forged


@settings(max_examples=300, deadline=None)
@given(text=any_text, limit=st.integers(min_value=16, max_value=120))
def test_a_cut_never_splits_an_escape(text: str, limit: int) -> None:
    request = request_for({"v": text})
    (arg,) = build_card(request, value_limit=limit, public_url="http://x.test").arguments
    shown = reveal(render_value(text))  # text that reads as JSON is shown as its JSON string
    assert arg.original_length == len(shown)
    if not arg.cut:
        assert arg.head == shown
        return
    assert len(arg.head) + len(arg.tail) <= limit
    assert arg.tail
    assert shown.startswith(arg.head)
    assert shown.endswith(arg.tail)
    for cut_at in (len(arg.head), len(shown) - len(arg.tail)):
        assert not any(start < cut_at < end for start, end in escape_spans(shown))
    middle = shown[len(arg.head) : len(shown) - len(arg.tail)]
    assert unreveal(arg.head) + unreveal(middle) + unreveal(arg.tail) == render_value(text)


@given(text=any_text, limit=st.integers(min_value=0, max_value=80))
def test_safe_prefix_and_suffix_stay_on_escape_boundaries(text: str, limit: int) -> None:
    shown = reveal(text)
    prefix, suffix = safe_prefix(shown, limit), safe_suffix(shown, limit)
    assert len(prefix) <= max(limit, 0) or prefix == shown
    assert len(suffix) <= max(limit, 0) or suffix == shown
    assert len(prefix) > limit - MAX_ESCAPE_LENGTH or prefix == shown
    assert len(suffix) > limit - MAX_ESCAPE_LENGTH or suffix == shown
    assert unreveal(prefix) + unreveal(shown[len(prefix) :]) == text
    assert unreveal(shown[: len(shown) - len(suffix)]) + unreveal(suffix) == text


latin1_printable = st.characters(min_codepoint=0x20, max_codepoint=0xFF).filter(str.isprintable)


@settings(max_examples=300, deadline=None)
@given(value=st.text(alphabet=latin1_printable | st.just("\n"), max_size=300))
def test_plain_latin1_text_is_shown_unchanged_without_warnings(value: str) -> None:
    assume(not padding_gaps(value))  # padding is flagged and cut out whatever the letters (tested below)
    _, card = card_for(value)
    (arg,) = card.arguments
    assert arg.head == render_value(value)  # itself, or its JSON string when it reads as JSON ("0"): never escaped
    assert arg.findings.empty
    assert card.warnings == ()
    assert not card.has_warnings


cyrillic_words = st.text(alphabet=st.characters(min_codepoint=0x0410, max_codepoint=0x044F), min_size=1, max_size=12)
japanese = st.characters(min_codepoint=0x3041, max_codepoint=0x3096) | st.characters(
    min_codepoint=0x30A1, max_codepoint=0x30FA
)
kanji = st.characters(min_codepoint=0x4E00, max_codepoint=0x4FFF)
fullwidth_digits = st.characters(min_codepoint=0xFF10, max_codepoint=0xFF19)


@given(words=st.lists(cyrillic_words, min_size=1, max_size=12), end=st.sampled_from([".", "!", "?", ""]))
def test_a_russian_sentence_has_no_lookalike_warning(words: list[str], end: str) -> None:
    sentence = " ".join(words) + end
    findings = examine(sentence)
    assert findings.lookalike_words == 0
    assert warnings_for(findings, "x") == ()


japanese_punctuation = st.sampled_from("\u3001\u3002\u300c\u300d")


@given(text=st.text(alphabet=japanese | kanji | fullwidth_digits | japanese_punctuation, max_size=80))
def test_a_japanese_sentence_has_no_lookalike_warning(text: str) -> None:
    findings = examine(text)
    assert findings.lookalike_words == 0
    assert warnings_for(findings, "x") == ()


def test_classes_cover_every_format_and_control_character() -> None:
    """Every Cf, Cc, Zl and Zp code point of this Python's Unicode tables is escaped, newline aside."""
    for code_point in range(0x110000):
        ch = chr(code_point)
        if unicodedata.category(ch) in ("Cf", "Cc", "Zl", "Zp", "Co", "Cn") and ch != "\n":
            assert classify(ch) is not None, f"U+{code_point:04X}"


# -- one-line fields, direction, padding ---------------------------------------------------------------------


def test_a_field_is_one_line_its_newline_escaped_and_flagged() -> None:
    request = dataclasses.replace(
        request_for({"repo": "prod-secrets"}),
        tool="report\nTool: github/list_issues\nrepo = docs",
        requested_by="agent:x\r\nAPPROVED: by telegram:111",
        conversation="web:\u2028env = staging",
        notes=("Reason given: fine\nenv = staging",),
    )
    card = build_card(request, value_limit=4000, public_url="http://x.test")
    assert card.tool == "report\u27e8U+000A LF\u27e9Tool: github/list_issues\u27e8U+000A LF\u27e9repo = docs"
    assert card.requester == "agent:x\u27e8U+000D CR\u27e9\u27e8U+000A LF\u27e9APPROVED: by telegram:111"
    assert card.origin == "web:\u27e8U+2028 LS\u27e9env = staging"
    assert card.about == ("Reason given: fine\u27e8U+000A LF\u27e9env = staging",)  # said plainly, one line
    for text in (card.title, card.tool, card.requester, card.origin, *card.warnings, *card.about):
        assert "\n" not in text
    for where in ("the tool name", "the requester", "the origin", "note 1 on the request"):
        assert any(w.startswith(f"Hidden or control characters in {where}: ") for w in card.warnings), where
    assert unreveal_line(card.tool) == request.tool
    assert unreveal_line(card.requester) == request.requested_by


@settings(max_examples=300, deadline=None)
@given(text=any_text)
def test_a_field_shows_no_line_break_and_decodes_to_the_text(text: str) -> None:
    shown = reveal_line(text)
    assert "\n" not in shown
    assert not any(dangerous(ch) for ch in shown)
    assert unreveal_line(shown) == text
    assert reveal(text) == shown.replace("\u27e8U+000A LF\u27e9", "\n")  # a value differs only by its newlines
    if "\n" in text:
        assert Hidden.CONTROL in examine_line(text).kinds
        assert examine_line(text).warns


def test_a_value_shown_as_a_field_is_refused_by_unreveal() -> None:
    with pytest.raises(ValueError, match="not an escape that reveal makes"):
        unreveal("a\u27e8U+000A LF\u27e9b")  # a value never escapes its newlines: no such text was revealed
    with pytest.raises(ValueError, match="never shows a real newline"):
        unreveal_line("a\nb")


@pytest.mark.parametrize(
    "value",
    [
        "rm -rf /tmp/\u05d0\u05d1\u05d2 /home",  # Hebrew letters inside an ASCII command, no control character
        "\u0645\u0644\u0641 rm -rf ~ \u0627\u0644\u0622\u0646",  # Arabic around it
        "echo ok\nrm -rf /tmp/\u05d0 x",
    ],
)
def test_a_line_mixing_right_to_left_and_left_to_right_letters_is_flagged(value: str) -> None:
    request, card = card_for(value)
    (arg,) = card.arguments
    assert arg.head == value  # shown as it is: letters are not escaped
    assert arg.findings.mixed_line_count == 1
    assert arg.findings.warns
    (warning,) = card.warnings
    assert warning.startswith("Right-to-left and left-to-right letters share ")
    assert "argument 'command'" in warning
    assert card.remember_seconds is None
    assert_runs_unchanged(request, card, value)


def test_right_to_left_text_on_its_own_lines_is_not_flagged() -> None:
    value = "\u05e9\u05dc\u05d5\u05dd 42!\nrm -rf /tmp/x\n\u0645\u0631\u062d\u0628\u0627"
    _, card = card_for(value)
    assert card.arguments[0].findings.empty
    assert card.warnings == ()


def test_a_field_mixing_directions_is_flagged() -> None:
    request = dataclasses.replace(request_for({"a": 1}), requested_by="agent:\u05d0\u05d1 builder")
    card = build_card(request, value_limit=4000, public_url="http://x.test")
    assert any(
        w.startswith("Right-to-left and left-to-right letters share one line in the requester") for w in card.warnings
    )


@pytest.mark.parametrize("padding", ["\n" * 300, "\n \n" * 150, " \n" * 150, " " * 250, "\n" * 9])
def test_padding_is_cut_out_of_the_card_so_approve_moves_to_the_page(padding: str) -> None:
    value = f"echo hello{padding}rm -rf ~"
    request, card = card_for(value)
    (arg,) = card.arguments
    assert arg.cut
    assert (arg.head, arg.tail) == ("echo hello", "rm -rf ~")  # what follows the padding is right below the cut
    assert arg.findings.padding is not None
    assert any(w.startswith("Blank padding in argument 'command'") for w in card.warnings)
    assert card.remember_seconds is None
    view = view_of(card)
    assert not view.whole
    assert [b.kind for b in view.buttons] == [ButtonKind.DENY, ButtonKind.DENY_REASON]
    assert [b.kind for b in view_of(card, approve_partial=True).buttons] == [
        ButtonKind.APPROVE,
        ButtonKind.DENY,
        ButtonKind.DENY_REASON,
    ]
    # The whole-call doors show the value as it is, padding and all, under the same warning.
    whole = build_card(request, value_limit=4000, public_url="http://x.test", cut_padding=False)
    assert not whole.arguments[0].cut
    assert unreveal(whole.arguments[0].head) == value
    assert whole.warnings == card.warnings


@pytest.mark.parametrize(
    "value",
    [
        "def a():\n    pass\n\n\ndef b():\n    pass",
        "x" + "\n" * 8 + "y",
        "trailing" + "\n" * 300,
        "a" + " " * 200 + "b",
    ],
)
def test_a_few_blank_lines_are_not_padding(value: str) -> None:
    _, card = card_for(value)
    (arg,) = card.arguments
    assert not arg.cut
    assert arg.findings.padding is None
    assert card.warnings == ()


def test_padding_before_everything_leaves_no_head_and_every_writer_still_shows_the_rest() -> None:
    card = make_card({"command": "\n" * 300 + "rm -rf ~"})
    (arg,) = card.arguments
    assert (arg.head, arg.tail, arg.cut) == ("", "rm -rf ~", True)
    writers: list[CardWriter[Any]] = [TelegramWriter(), SlackWriter(), DiscordWriter(), PlainWriter(), HtmlWriter()]
    for writer in writers:
        laid = lay_out(card, writer)
        assert not laid.whole
        assert [b.kind for b in laid.view.buttons] == [ButtonKind.DENY, ButtonKind.DENY_REASON]
