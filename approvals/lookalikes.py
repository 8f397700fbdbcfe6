"""Look-alike words: scripts mixed inside a word, a Latin-looking part spelled in another script, fullwidth forms.

A *word* is a run of letters, marks and digits, joined across single ``.``,
``-`` and ``_`` (so ``gіthub.com`` and ``my-host_1`` are one word); each
piece between joiners is a *label*. Three findings:

- ``mixed-script``: a label holds letters of two scripts from
  :data:`CONFUSABLE_SCRIPTS` (``gіthub`` = Latin + Cyrillic ``і``).
- ``whole-script``: a word has an all-Latin label and another label written
  entirely in Cyrillic, Greek or Armenian letters that look Latin
  (``аррӏе.com``): the classic look-alike host name.
- ``compatibility``: a label that reads as Latin holds fullwidth or
  compatibility forms of ASCII letters or digits (``ｇ``, ``𝐠``, ``ﬁ``, ``K``
  KELVIN SIGN) beside ordinary ASCII ones (``ｇithub``).

Python has no Unicode script property, so a letter's script is the first word
of its Unicode name after NFKC (``CYRILLIC SMALL LETTER BYELORUSSIAN-UKRAINIAN
I`` → Cyrillic); Latin-1 letters (``µ``, ``ª``) count as Latin. Digits, marks,
modifier letters and punctuation have no script here (Common/Inherited). This
is right for the alphabets look-alikes come from; for the rest it only needs
to tell scripts apart. Limits: a whole word in one foreign script is flagged
only beside a Latin label and only from the small table below; combining marks
on Latin letters, modifier letters, and words written entirely in fullwidth or
mathematical letters are not flagged; mixes of Latin with scripts that are not
look-alike sources (Latin + Han/Kana/Hangul, Latin + Arabic) are not flagged,
so Japanese, Chinese and Korean text stays quiet, as does a sentence in one
script.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

MAX_WORDS = 3  # look-alike words listed per text
MAX_FOREIGN = 4  # foreign characters listed per word

CONFUSABLE_SCRIPTS = frozenset(
    {
        "Latin",
        "Cyrillic",
        "Greek",
        "Armenian",
        "Cherokee",
        "Coptic",
        "Georgian",
        "Lisu",
        "Canadian Syllabics",
        "Tifinagh",
        "Osage",
    }
)
_ALIASES = {"CJK": "Han", "CANADIAN": "Canadian Syllabics"}
_WHOLE_SCRIPTS = frozenset({"Cyrillic", "Greek", "Armenian"})
# Cyrillic, Greek and Armenian letters that read as Latin ones in common fonts (written as escapes: ruff and
# editors rightly complain about the real characters in source).
_LATIN_LOOKALIKES = frozenset(
    "\u0405\u0406\u0408\u0410\u0412\u0415\u041a\u041c\u041d\u041e\u0420\u0421\u0422\u0423\u0425"
    "\u0430\u0435\u043e\u0440\u0441\u0443\u0445\u0455\u0456\u0458\u04ae\u04af\u04ba\u04bb\u04c0\u04cf"
    "\u0501\u051a\u051b\u051c\u051d"
    "\u0391\u0392\u0395\u0396\u0397\u0399\u039a\u039c\u039d\u039f\u03a1\u03a4\u03a5\u03a7"
    "\u03b1\u03b9\u03ba\u03bd\u03bf\u03c1\u03c5\u03f2\u03f3\u03f9"
    "\u053c\u054d\u054f\u0555\u0561\u0566\u0570\u0578\u057d\u0581\u0585"
)
_LABEL_SPLIT = re.compile(r"[._-]+")
_JOINERS = frozenset("._-")


class LookAlikeKind(StrEnum):
    MIXED = "mixed-script"
    WHOLE = "whole-script"
    COMPAT = "compatibility"


@dataclass(frozen=True)
class LookAlike:
    kind: LookAlikeKind
    word: str  # as shown (escaped), shortened with "…" when long
    scripts: tuple[str, ...]  # the expected script first: ("Latin", "Cyrillic")
    foreign: tuple[int, ...]  # distinct code points of the look-alike characters, at most MAX_FOREIGN


@lru_cache(maxsize=8192)
def script_of(ch: str) -> str | None:
    """The script of a letter, from its Unicode name; None for digits, marks, punctuation, modifier letters."""
    category = unicodedata.category(ch)
    if category[0] != "L" or category == "Lm":
        return None
    if ord(ch) < 0x100:  # Latin-1 letters, µ and ª included, are ordinary Latin text
        return "Latin"
    base = unicodedata.normalize("NFKC", ch)[:1] or ch
    if ord(base) < 0x100:
        return "Latin" if base.isalpha() else None
    first = unicodedata.name(base, "").split(" ", 1)[0]
    if not first:
        return None
    return _ALIASES.get(first, first.title())


@lru_cache(maxsize=8192)
def is_ascii_compat(ch: str) -> bool:
    """A fullwidth or compatibility form of ASCII letters or digits (Latin-1 itself excluded: ª, ², µ are ordinary)."""
    if ord(ch) < 0x100:
        return False
    folded = unicodedata.normalize("NFKC", ch)
    return folded != ch and folded.isascii() and folded.isalnum()


def _is_word(ch: str) -> bool:
    return unicodedata.category(ch)[0] in "LMN"


def words(text: str) -> list[str]:
    """Runs of letters, marks and digits, joined across single ``.``, ``-``, ``_`` between word characters."""
    found: list[str] = []
    start: int | None = None
    for index, ch in enumerate(text):
        if _is_word(ch):
            if start is None:
                start = index
            continue
        if start is not None and ch in _JOINERS and index + 1 < len(text) and _is_word(text[index + 1]):
            continue
        if start is not None:
            found.append(text[start:index])
            start = None
    if start is not None:
        found.append(text[start:])
    return found


def _distinct(chars: list[str]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ord(c) for c in chars))[:MAX_FOREIGN]


def _mixed(labels: list[str]) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    letters: list[tuple[str, str]] = []
    for label in labels:
        scripts = [(ch, s) for ch in label if (s := script_of(ch)) in CONFUSABLE_SCRIPTS]
        if len({s for _, s in scripts}) >= 2:
            letters += scripts
    if not letters:
        return None
    counts = Counter(s for _, s in letters)
    main = "Latin" if "Latin" in counts else counts.most_common(1)[0][0]
    others = tuple(s for s, _ in counts.most_common() if s != main)
    return (main, *others), _distinct([ch for ch, s in letters if s != main])


def _whole(labels: list[str]) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    scripts_of = [{s for ch in label if (s := script_of(ch)) is not None} for label in labels]
    if {"Latin"} not in scripts_of:
        return None
    for label, scripts in zip(labels, scripts_of, strict=True):
        if len(scripts) != 1 or not scripts <= _WHOLE_SCRIPTS:
            continue
        letters = [ch for ch in label if script_of(ch) is not None]
        if all(ch in _LATIN_LOOKALIKES for ch in letters):
            return ("Latin", *scripts), _distinct(letters)
    return None


def _compat(labels: list[str]) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    forms: list[str] = []
    for label in labels:
        # Only in a label that reads as Latin: fullwidth digits beside kana and kanji are ordinary Japanese.
        if any(script_of(ch) not in (None, "Latin") for ch in label):
            continue
        found = [ch for ch in label if is_ascii_compat(ch)]
        if found and any(ch.isascii() and ch.isalnum() for ch in label):
            forms += found
    return (("ASCII", "compatibility forms"), _distinct(forms)) if forms else None


def find_lookalikes(text: str, *, show: Callable[[str], str]) -> tuple[tuple[LookAlike, ...], int]:
    """The first :data:`MAX_WORDS` look-alike findings in ``text``, and how many there are in all.

    ``show`` turns a word into what a person sees (escaping, shortening); a word repeated counts once.
    """
    if text.isascii():
        return (), 0
    seen: set[tuple[LookAlikeKind, str]] = set()
    listed: list[LookAlike] = []
    for word in words(text):
        if word.isascii():
            continue
        labels = [label for label in _LABEL_SPLIT.split(word) if label]
        checks = (
            (LookAlikeKind.MIXED, _mixed(labels)),
            (LookAlikeKind.WHOLE, _whole(labels)),
            (LookAlikeKind.COMPAT, _compat(labels)),
        )
        for kind, found in checks:
            if found is None or (kind, word) in seen:
                continue
            seen.add((kind, word))
            if len(listed) < MAX_WORDS:
                listed.append(LookAlike(kind=kind, word=show(word), scripts=found[0], foreign=found[1]))
    return tuple(listed), len(seen)
