"""What a person must see: hidden, direction-changing and control characters escaped, look-alikes found.

Every character of the classes in :class:`Hidden` is shown as one escape,
``⟨U+XXXX⟩`` or ``⟨U+XXXX NAME⟩`` (``⟨U+202E RLO⟩``, ``⟨U+000D CR⟩``,
``⟨U+001B ESC⟩``): hex upper case, at least four digits, an optional short
name, never longer than :data:`MAX_ESCAPE_LENGTH`. The opening bracket ``⟨``
(U+27E8) and the brackets that look like it are escaped themselves when a
value holds them, so every ``⟨`` in shown text starts a real escape and a value
cannot forge one: :func:`unreveal` inverts :func:`reveal` exactly, which is
what lets tests prove that what is shown is what runs.

Two kinds of text. An argument *value* keeps its newlines as real newlines
(multi-line commands are normal; every card writer shows a value's lines
visibly inside the value: a code block, or an indented quote). Every other
text on a card — the tool name, the requester, the origin, notes, argument
names, an outcome's words — is a *field*: one line, always. :func:`reveal_line`
and :func:`examine_line` escape and flag a newline in a field like any other
control character (``⟨U+000A LF⟩``), so no field can start a line that looks
like a card's own (``Tool:``, ``APPROVED: …``).

Tab is escaped as ``⟨U+0009 TAB⟩``: every platform shows it as blank space of
unknown width, terminals move the cursor over it without writing, and tab
versus spaces changes meaning (Makefile recipes, ``<<-`` here-documents, TSV,
patterns). It is reported but raises no warning: once escaped it cannot
deceive. Every space but the ASCII one (no-break U+00A0, U+202F, ideographic
U+3000, ogham U+1680, the typographic U+2000–U+200A) is escaped and flagged:
it looks like a space and is not one to the program that runs.

Also flagged, with the text shown as it is: look-alike words (see
:mod:`kazma.approvals.lookalikes`); a line that holds both right-to-left and
left-to-right letters (a display reorders such a line around the right-to-left
run even with no control character in it, so ``rm -rf /tmp/x`` with Hebrew
letters inside may not read in the order it runs); and *padding* in a value, a
run of blank lines or spaces long enough to push the rest of the value out of
view (:func:`padding_gaps`; a card cuts it out, see :mod:`kazma.approvals.card`).

Pure functions, no I/O.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

from kazma.approvals.lookalikes import LookAlike, LookAlikeKind, find_lookalikes
from kazma.approvals.unicode_data import ascii_lookalike

ESCAPE_OPEN = "\u27e8"  # ⟨ MATHEMATICAL LEFT ANGLE BRACKET
ESCAPE_CLOSE = "\u27e9"  # ⟩ MATHEMATICAL RIGHT ANGLE BRACKET
MAX_ESCAPE_LENGTH = 16  # the longest escape, e.g. ``⟨U+E007F CANCEL⟩``; a cut budget must hold one
MAX_LISTED_CODE_POINTS = 3  # per class in findings and warnings
MAX_LISTED_KINDS = 4  # classes named in one warning sentence
MAX_WORD_LENGTH = 40  # shown characters of a look-alike word quoted in a warning


class Hidden(StrEnum):
    """Classes of characters that are shown escaped."""

    BIDI = "bidi"  # U+202A–U+202E, U+2066–U+2069, U+200E, U+200F, U+061C
    ZERO_WIDTH = "zero-width"  # U+200B–U+200D, U+2060, U+FEFF
    TAG = "tag"  # U+E0000–U+E007F
    VARIATION = "variation"  # U+FE00–U+FE0F, U+E0100–U+E01EF, U+180B–U+180D, U+180F
    FILLER = "filler"  # blank-looking letters and marks: U+115F, U+1160, U+3164, U+FFA0, U+2800, U+034F, …
    SPACE = "space"  # every space but U+0020 (Zs): U+00A0, U+1680, U+2000–U+200A, U+202F, U+205F, U+3000
    SEPARATOR = "separator"  # U+2028 LINE SEPARATOR, U+2029 PARAGRAPH SEPARATOR
    FORMAT = "format"  # every other format character (category Cf), e.g. U+00AD, U+2061, U+206A
    CONTROL = "control"  # C0 U+0000–U+001F but tab (and LF in a value), DEL U+007F, C1 U+0080–U+009F
    UNKNOWN = "unknown"  # unassigned (Cn), private-use (Co) and surrogate (Cs) code points
    BRACKET = "bracket"  # the escape's own bracket and its look-alikes: U+27E8, U+2329, U+3008, U+276C, U+29FC
    TAB = "tab"  # U+0009, escaped without a warning

    @property
    def label(self) -> str:
        return _LABELS[self]

    @property
    def warns(self) -> bool:
        return self is not Hidden.TAB


_LABELS = {
    Hidden.BIDI: "direction controls",
    Hidden.ZERO_WIDTH: "zero-width characters",
    Hidden.TAG: "invisible tag characters",
    Hidden.VARIATION: "variation selectors",
    Hidden.FILLER: "invisible fillers",
    Hidden.SPACE: "unusual spaces",
    Hidden.SEPARATOR: "line/paragraph separators",
    Hidden.FORMAT: "invisible format characters",
    Hidden.CONTROL: "control characters",
    Hidden.UNKNOWN: "unassigned or private-use characters",
    Hidden.BRACKET: "characters that look like the escape bracket",
    Hidden.TAB: "tabs",
}

_BIDI = {0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)}
_ZERO_WIDTH = {0x200B, 0x200C, 0x200D, 0x2060, 0xFEFF}
_VARIATION = {*range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0), 0x180B, 0x180C, 0x180D, 0x180F}
# Letters and marks that are assigned and "visible" by category yet draw nothing.
_FILLERS = {0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x2800, 0x3164, 0xFFA0}
_BRACKETS = {0x27E8, 0x2329, 0x3008, 0x276C, 0x29FC}

# fmt: off
_C0_NAMES = (
    "NUL", "SOH", "STX", "ETX", "EOT", "ENQ", "ACK", "BEL", "BS", "TAB", "LF", "VT", "FF", "CR", "SO", "SI",
    "DLE", "DC1", "DC2", "DC3", "DC4", "NAK", "SYN", "ETB", "CAN", "EM", "SUB", "ESC", "FS", "GS", "RS", "US",
)
_C1_NAMES = (
    "PAD", "HOP", "BPH", "NBH", "IND", "NEL", "SSA", "ESA", "HTS", "HTJ", "VTS", "PLD", "PLU", "RI", "SS2", "SS3",
    "DCS", "PU1", "PU2", "STS", "CCH", "MW", "SPA", "EPA", "SOS", "SGCI", "SCI", "CSI", "ST", "OSC", "PM", "APC",
)
# fmt: on
_NAMES: dict[int, str] = {
    **dict(enumerate(_C0_NAMES)),
    **{0x80 + i: name for i, name in enumerate(_C1_NAMES)},
    0x7F: "DEL",
    0x00A0: "NBSP",
    0x00AD: "SHY",
    0x202F: "NNBSP",
    0x061C: "ALM",
    0x180E: "MVS",
    0x200B: "ZWSP",
    0x200C: "ZWNJ",
    0x200D: "ZWJ",
    0x200E: "LRM",
    0x200F: "RLM",
    0x2028: "LS",
    0x2029: "PS",
    0x202A: "LRE",
    0x202B: "RLE",
    0x202C: "PDF",
    0x202D: "LRO",
    0x202E: "RLO",
    0x2060: "WJ",
    0x2066: "LRI",
    0x2067: "RLI",
    0x2068: "FSI",
    0x2069: "PDI",
    0xFEFF: "BOM",
    0x034F: "CGJ",
    0xE0001: "LANG",
    0xE0020: "TAG SP",
    0xE007F: "CANCEL",
    **{0xE0021 + i: f"TAG {chr(0x21 + i)}" for i in range(0x7E - 0x21 + 1)},
    **{0xFE00 + i: f"VS{i + 1}" for i in range(16)},
    **{0xE0100 + i: f"VS{i + 17}" for i in range(240)},
}

_ESCAPE = re.compile("\u27e8U\\+([0-9A-F]{4,6})(?: [^\u27e8\u27e9]+)?\u27e9")
_SPAN = re.compile("\u27e8[^\u27e9]*\u27e9")
_ASCII_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f]")
_ASCII_CONTROL_LINE = re.compile("[\x00-\x1f\x7f]")
LINE_FEED = "\n"

# Padding: a run of blanks (spaces and line breaks, the only characters reveal leaves blank) that holds more than
# MAX_GAP_LINES line breaks, or is longer than MAX_GAP_WIDTH, with something after it. Legitimate text has a few
# blank lines in a row (two between functions, three at most in most styles); eight already push a phone screen's
# worth of a card out of view.
MAX_GAP_LINES = 8
MAX_GAP_WIDTH = 200
MAX_LISTED_LINES = 3  # line numbers named in a mixed-direction warning
_BLANKS = re.compile("[ \n]+")
_RTL = frozenset({"R", "AL"})


@lru_cache(maxsize=8192)
def classify(ch: str) -> Hidden | None:
    """The class ``ch`` is escaped for, or None when it is shown as itself."""
    cp = ord(ch)
    if 0x20 <= cp < 0x7F or cp == 0x0A:
        return None
    if cp == 0x09:
        return Hidden.TAB
    category = unicodedata.category(ch)
    if category == "Cc":
        return Hidden.CONTROL
    if cp in _BIDI:
        return Hidden.BIDI
    if cp in _ZERO_WIDTH:
        return Hidden.ZERO_WIDTH
    if 0xE0000 <= cp <= 0xE007F:
        return Hidden.TAG
    if cp in _VARIATION:
        return Hidden.VARIATION
    if cp in _FILLERS:
        return Hidden.FILLER
    if category == "Zs":  # U+0020 returned above
        return Hidden.SPACE
    if category in ("Zl", "Zp"):
        return Hidden.SEPARATOR
    if category == "Cf":
        return Hidden.FORMAT
    # Unassigned in this Python's Unicode tables may be a newer invisible character; private use draws anything.
    if category in ("Cn", "Co", "Cs"):
        return Hidden.UNKNOWN
    if cp in _BRACKETS:
        return Hidden.BRACKET
    return None


def escape(code_point: int) -> str:
    """The escape for one code point: ``⟨U+202E RLO⟩``, ``⟨U+3164⟩``."""
    name = _NAMES.get(code_point)
    return f"{ESCAPE_OPEN}U+{code_point:04X}{' ' + name if name else ''}{ESCAPE_CLOSE}"


def code_point_label(code_point: int) -> str:
    """``U+202E RLO`` (the escape without its brackets), for warnings."""
    return escape(code_point)[1:-1]


def classify_in_field(ch: str) -> Hidden | None:
    """:func:`classify` for a one-line field: a newline is a control character there."""
    return Hidden.CONTROL if ch == LINE_FEED else classify(ch)


def reveal(text: str) -> str:
    """``text`` (an argument value) with every character of a :class:`Hidden` class replaced by its escape."""
    if text.isascii() and _ASCII_CONTROL.search(text) is None:
        return text
    return "".join(ch if classify(ch) is None else escape(ord(ch)) for ch in text)


def reveal_line(text: str) -> str:
    """``text`` as a one-line field: :func:`reveal`, and a newline escaped as ``⟨U+000A LF⟩`` too."""
    if text.isascii() and _ASCII_CONTROL_LINE.search(text) is None:
        return text
    return "".join(ch if classify_in_field(ch) is None else escape(ord(ch)) for ch in text)


def unreveal_line(shown: str) -> str:
    """The text that :func:`reveal_line` turned into ``shown``; ValueError when ``shown`` is not such a text."""
    if LINE_FEED in shown:
        raise ValueError("a one-line field never shows a real newline")
    return _unreveal(shown, classify_in_field)


def unreveal(shown: str) -> str:
    """The text that :func:`reveal` turned into ``shown``; ValueError when ``shown`` is not such a text."""
    return _unreveal(shown, classify)


def _unreveal(shown: str, classes: Callable[[str], Hidden | None]) -> str:
    out: list[str] = []
    pos = 0
    while (start := shown.find(ESCAPE_OPEN, pos)) >= 0:
        match = _ESCAPE.match(shown, start)
        if match is None:
            raise ValueError(f"malformed escape at {start}: {shown[start : start + MAX_ESCAPE_LENGTH]!r}")
        code_point = int(match[1], 16)
        if code_point > 0x10FFFF or match[0] != escape(code_point) or classes(chr(code_point)) is None:
            raise ValueError(f"not an escape that reveal makes: {match[0]!r}")
        out += [shown[pos:start], chr(code_point)]
        pos = match.end()
    out.append(shown[pos:])
    return "".join(out)


def escape_spans(shown: str) -> tuple[tuple[int, int], ...]:
    """``(start, end)`` of every escape in ``shown``: a cut must not fall strictly inside one."""
    return tuple(m.span() for m in _SPAN.finditer(shown))


def _enclosing(shown: str, index: int) -> tuple[int, int] | None:
    """The escape that ``index`` falls strictly inside, if any (escapes hold no inner ``⟨``)."""
    start = shown.rfind(ESCAPE_OPEN, 0, index)
    if start < 0:
        return None
    end = shown.find(ESCAPE_CLOSE, start)
    if end < 0 or end >= index:
        return (start, len(shown) if end < 0 else end + 1)
    return None


def safe_prefix(shown: str, limit: int) -> str:
    """The longest prefix of at most ``limit`` characters that does not end inside an escape."""
    if limit >= len(shown):
        return shown
    cut = max(limit, 0)
    span = _enclosing(shown, cut)
    return shown[: span[0] if span else cut]


def safe_suffix(shown: str, limit: int) -> str:
    """The longest suffix of at most ``limit`` characters that does not start inside an escape."""
    if limit >= len(shown):
        return shown
    cut = len(shown) - max(limit, 0)
    span = _enclosing(shown, cut)
    return shown[span[1] if span else cut :]


@dataclass(frozen=True)
class CodePointCount:
    code_point: int
    count: int

    def __str__(self) -> str:
        return f"{self.count} × {code_point_label(self.code_point)}"


@dataclass(frozen=True)
class HiddenFinding:
    """One class found in a text: how many characters, and the most frequent code points (bounded)."""

    kind: Hidden
    count: int
    code_points: tuple[CodePointCount, ...]  # at most MAX_LISTED_CODE_POINTS, most frequent first
    distinct: int  # distinct code points of this class in the text

    def describe(self) -> str:
        listed = ", ".join(str(c) for c in self.code_points)
        more = ", …" if self.distinct > len(self.code_points) else ""
        return f"{self.kind.label} ({listed}{more})"


@dataclass(frozen=True)
class Padding:
    """Blank runs that push the rest of a text out of view (see :func:`padding_gaps`)."""

    gaps: int  # how many such runs
    breaks: int  # the most line breaks in one run
    width: int  # the most characters in one run

    def describe(self) -> str:
        run = (
            f"{self.breaks - 1:,} blank lines in a row"
            if self.breaks > MAX_GAP_LINES
            else f"a run of {self.width:,} blank characters"
        )
        more = f" ({self.gaps} such runs)" if self.gaps > 1 else ""
        return f"{run}{more}"


@dataclass(frozen=True)
class Findings:
    """What :func:`examine` found in one text. Empty means nothing to escape and nothing to flag."""

    hidden: tuple[HiddenFinding, ...] = ()  # in :class:`Hidden` order
    lookalikes: tuple[LookAlike, ...] = ()  # the first few flagged words
    lookalike_words: int = 0  # every flagged word, listed or not
    mixed_lines: tuple[int, ...] = ()  # 1-based numbers of the first lines mixing right-to-left and left-to-right
    mixed_line_count: int = 0  # every such line, listed or not
    lines: int = 1  # lines in the text (a field is one line)
    padding: Padding | None = None
    field: bool = False  # the findings of a one-line field (:func:`examine_line`), not of a value

    @property
    def empty(self) -> bool:
        return not self.hidden and not self.lookalike_words and not self.mixed_line_count and self.padding is None

    @property
    def warns(self) -> bool:
        """True when a person must be warned (anything but tabs)."""
        return (
            self.lookalike_words > 0
            or self.mixed_line_count > 0
            or self.padding is not None
            or any(h.kind.warns for h in self.hidden)
        )

    @property
    def kinds(self) -> frozenset[Hidden]:
        return frozenset(h.kind for h in self.hidden)

    @property
    def hidden_count(self) -> int:
        return sum(h.count for h in self.hidden)


NO_FINDINGS = Findings()


@lru_cache(maxsize=8192)
def _direction(ch: str) -> str:
    return unicodedata.bidirectional(ch)


def _mixes_directions(line: str) -> bool:
    if line.isascii():
        return False
    ltr = rtl = False
    for ch in line:
        direction = _direction(ch)
        if direction == "L":
            ltr = True
        elif direction in _RTL:
            rtl = True
        else:
            continue
        if ltr and rtl:
            return True
    return False


def mixed_direction_lines(text: str, *, one_line: bool = False) -> list[int]:
    """1-based numbers of the lines of ``text`` holding both strong right-to-left and strong left-to-right letters.

    Such a line is laid out by the Unicode bidirectional algorithm, which moves
    the left-to-right runs around the right-to-left ones: with no control
    character at all, what a person reads may not be the order the line runs in.
    """
    if text.isascii():
        return []
    lines = [text] if one_line else text.split(LINE_FEED)
    return [number for number, line in enumerate(lines, 1) if _mixes_directions(line)]


def padding_gaps(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of every blank run in ``text`` that is padding: more than :data:`MAX_GAP_LINES` line breaks
    or :data:`MAX_GAP_WIDTH` characters, with something after it (trailing blanks hide nothing).

    Spaces and line breaks are the only characters :func:`reveal` leaves blank, so the runs are the same in a
    text and in its shown form (at other offsets).
    """
    # A run longer than MAX_GAP_WIDTH with at most MAX_GAP_LINES line breaks holds two spaces side by side.
    if text.count(LINE_FEED) <= MAX_GAP_LINES and "  " not in text:
        return []
    gaps: list[tuple[int, int]] = []
    for run in _BLANKS.finditer(text):
        if run.end() == len(text):
            continue
        blank = run.group()
        if blank.count(LINE_FEED) > MAX_GAP_LINES or len(blank) > MAX_GAP_WIDTH:
            gaps.append(run.span())
    return gaps


def _padding(text: str) -> Padding | None:
    gaps = padding_gaps(text)
    if not gaps:
        return None
    runs = [text[start:end] for start, end in gaps]
    return Padding(
        gaps=len(gaps), breaks=max(run.count(LINE_FEED) for run in runs), width=max(len(run) for run in runs)
    )


def examine(text: str) -> Findings:
    """Count the escaped classes in ``text`` (an argument value), find look-alike words, mixed-direction lines and
    padding (bounded lists)."""
    return _examine(text, one_line=False)


def examine_line(text: str) -> Findings:
    """:func:`examine` for a one-line field: a newline is a control character there (see :func:`reveal_line`)."""
    return _examine(text, one_line=True)


def _examine(text: str, *, one_line: bool) -> Findings:
    classes = classify_in_field if one_line else classify
    counts: Counter[int] = Counter(ord(ch) for ch in text if classes(ch) is not None)
    by_kind: dict[Hidden, Counter[int]] = {}
    for code_point, count in counts.items():
        kind = classes(chr(code_point))
        assert kind is not None
        by_kind.setdefault(kind, Counter())[code_point] = count
    hidden = tuple(
        HiddenFinding(
            kind=kind,
            count=sum(by_kind[kind].values()),
            code_points=tuple(CodePointCount(cp, n) for cp, n in by_kind[kind].most_common(MAX_LISTED_CODE_POINTS)),
            distinct=len(by_kind[kind]),
        )
        for kind in Hidden
        if kind in by_kind
    )
    listed, total = find_lookalikes(text, show=_show_word)
    mixed = mixed_direction_lines(text, one_line=one_line)
    padding = _padding(text)
    if not hidden and not total and not mixed and padding is None:
        return NO_FINDINGS
    return Findings(
        hidden=hidden,
        lookalikes=listed,
        lookalike_words=total,
        mixed_lines=tuple(mixed[:MAX_LISTED_LINES]),
        mixed_line_count=len(mixed),
        lines=1 if one_line else text.count(LINE_FEED) + 1,
        padding=padding,
        field=one_line,
    )


def _show_word(word: str) -> str:
    shown = reveal(word)
    return shown if len(shown) <= MAX_WORD_LENGTH else safe_prefix(shown, MAX_WORD_LENGTH - 1) + "…"


def _lookalike_phrase(found: LookAlike) -> str:
    chars = ", ".join(f"{reveal(chr(cp))} {code_point_label(cp)}" for cp in found.foreign)
    word = f"'{found.word}'"
    if found.kind is LookAlikeKind.MIXED:
        others = ", ".join(found.scripts[1:])
        return f"{word} mixes {found.scripts[0]} with {others} ({chars})"
    if found.kind is LookAlikeKind.WHOLE:
        return f"{word} spells a {found.scripts[1]} part with {found.scripts[0]} look-alikes ({chars})"
    if found.kind is LookAlikeKind.LATIN:
        stand_ins = ", ".join(
            f"{reveal(chr(cp))} {code_point_label(cp)} for {ascii_lookalike(chr(cp))}" for cp in found.foreign
        )
        return f"{word} spells ASCII letters with other letters that look like them ({stand_ins})"
    return f"{word} mixes ordinary letters with fullwidth or compatibility forms ({chars})"


def _more(count: int, noun: str) -> str:
    if count <= 0:
        return ""
    return f"; and {count} more {noun}{'' if count == 1 else 's'}"


def warnings_for(findings: Findings, where: str) -> tuple[str, ...]:
    """Short plain sentences for a card; ``where`` names the text, e.g. ``argument 'command'``.

    Empty when nothing warrants a warning (no findings, or only tabs). ``where`` is Kazma's own wording around
    shown (escaped) names, so every sentence is one line.
    """
    sentences: list[str] = []
    warned = [h for h in findings.hidden if h.kind.warns]
    if warned:
        parts = "; ".join(h.describe() for h in warned[:MAX_LISTED_KINDS])
        more = _more(len(warned) - MAX_LISTED_KINDS, "kind")
        sentences.append(
            f"Hidden or control characters in {where}: {parts}{more}. "
            f"They are shown escaped as {ESCAPE_OPEN}U+…{ESCAPE_CLOSE}; the text may not read the way it runs."
        )
    if findings.lookalikes:
        parts = "; ".join(_lookalike_phrase(found) for found in findings.lookalikes)
        more = _more(findings.lookalike_words - len(findings.lookalikes), "word")
        sentences.append(f"Look-alike characters in {where}: {parts}{more}.")
    if findings.mixed_line_count:
        sentences.append(
            f"Right-to-left and left-to-right letters share {_lines_phrase(findings)} in {where}: "
            "a display reorders such a line, so it may not read in the order it runs."
        )
    if findings.padding is not None:
        cut = (
            ""
            if findings.field
            else " The card leaves the padding out, shown as a cut: the call is approved only where it is seen whole."
        )
        sentences.append(
            f"Blank padding in {where} ({findings.padding.describe()}) pushes what follows out of view.{cut}"
        )
    return tuple(sentences)


def _lines_phrase(findings: Findings) -> str:
    if findings.field or findings.lines <= 1:
        return "one line"
    numbers = ", ".join(str(n) for n in findings.mixed_lines)
    more = ", …" if findings.mixed_line_count > len(findings.mixed_lines) else ""
    return f"line {numbers}{more}" if findings.mixed_line_count == 1 else f"lines {numbers}{more}"
