"""Look-alike words: scripts mixed inside a word, a word spelled in look-alikes of ASCII, fullwidth forms.

A *word* is a run of letters, marks and digits, joined across single ``.``,
``-`` and ``_`` (so ``gіthub.com`` and ``my-host_1`` are one word); each
piece between joiners is a *label*. Four findings:

- ``mixed-script``: a label holds letters of two scripts from
  :data:`CONFUSABLE_SCRIPTS` (``gіthub`` = Latin + Cyrillic ``і``), or Latin
  letters beside letters of any other script that look like ASCII ones.
- ``whole-script``: a word has an all-Latin label and another label written
  entirely in one other script whose every letter looks like an ASCII letter
  (``аррӏе.com`` in Cyrillic, ``ᏚᎢᎬ.com`` in Cherokee): the classic look-alike
  host name.
- ``latin-lookalike``: a label written in Latin letters whose letters outside
  ASCII all look like ASCII ones (``ɡithub`` with U+0261 SCRIPT G, ``gıthub``
  with U+0131 DOTLESS I, ``gɪthub`` with U+026A SMALL CAPITAL I): one script,
  so no mixed-script rule sees it.
- ``compatibility``: a label that reads as Latin holds fullwidth or
  compatibility forms of ASCII letters or digits (``ｇ``, ``𝐠``, ``ﬁ``, ``K``
  KELVIN SIGN) beside ordinary ASCII ones (``ｇithub``).

Which letter looks like which, and a letter's script, come from Unicode's own
data (UTS #39 ``confusables.txt`` and ``Scripts.txt``, see
:mod:`kazma.approvals.unicode_data`), not from a hand list. Latin-1 letters
(``é``, ``ß``, ``æ``, ``µ``, ``ª``) are ordinary Latin text and never flagged;
a label holding any letter that looks like no ASCII one (``çalıştır``,
``Straße``) is not an ASCII look-alike (a plain Turkish word with ``ı`` and
otherwise ASCII letters, ``kapı``, is: it reads as ``kapi``). Digits, marks,
modifier letters and punctuation have no script here (Common/Inherited).
Limits: a whole word in one foreign script is flagged only beside a Latin
label; combining marks on Latin letters, modifier letters, and words written
entirely in fullwidth or mathematical letters are not flagged; mixes of Latin
with scripts whose letters look like no ASCII letter (Latin + Han/Kana/Hangul,
Latin + Hebrew) are not flagged, so Japanese, Chinese and Korean text stays
quiet, as does a sentence in one script.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

from kazma.approvals.unicode_data import ascii_lookalike, script

MAX_WORDS = 3  # look-alike words listed per text
MAX_FOREIGN = 4  # foreign characters listed per word

# Scripts whose letters are mixed into one another to spoof words (any two of them in one label are flagged).
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
        "Canadian Aboriginal",
        "Tifinagh",
        "Osage",
    }
)
_LABEL_SPLIT = re.compile(r"[._-]+")
_JOINERS = frozenset("._-")


class LookAlikeKind(StrEnum):
    MIXED = "mixed-script"
    WHOLE = "whole-script"
    LATIN = "latin-lookalike"
    COMPAT = "compatibility"


@dataclass(frozen=True)
class LookAlike:
    kind: LookAlikeKind
    word: str  # as shown (escaped), shortened with "…" when long
    scripts: tuple[str, ...]  # the expected script first: ("Latin", "Cyrillic")
    foreign: tuple[int, ...]  # distinct code points of the look-alike characters, at most MAX_FOREIGN


@lru_cache(maxsize=8192)
def script_of(ch: str) -> str | None:
    """The Unicode script of a letter; None for digits, marks, punctuation, modifier letters and Common letters."""
    category = unicodedata.category(ch)
    if category[0] != "L" or category == "Lm":
        return None
    if ord(ch) < 0x100:  # Latin-1 letters, µ and ª included, are ordinary Latin text
        return "Latin"
    return script(ch)


def looks_ascii(ch: str) -> bool:
    """``ch`` is outside Latin-1 and UTS #39 says it is confusable with ASCII letters or digits."""
    return ord(ch) >= 0x100 and ascii_lookalike(ch) is not None


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


def _mixes(scripts: list[tuple[str, str]]) -> bool:
    names = {s for _, s in scripts}
    if len(names & CONFUSABLE_SCRIPTS) >= 2:
        return True
    # Latin beside a script outside the list: flagged when a letter of that script looks like an ASCII one.
    return "Latin" in names and any(s != "Latin" and looks_ascii(ch) for ch, s in scripts)


def _mixed(labels: list[str]) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    letters: list[tuple[str, str]] = []
    for label in labels:
        scripts = [(ch, s) for ch in label if (s := script_of(ch)) is not None]
        if _mixes(scripts):
            letters += [(ch, s) for ch, s in scripts if s in CONFUSABLE_SCRIPTS or s == "Latin" or looks_ascii(ch)]
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
        if len(scripts) != 1 or scripts == {"Latin"}:
            continue
        letters = [ch for ch in label if script_of(ch) is not None]
        if all(looks_ascii(ch) for ch in letters):
            return ("Latin", *scripts), _distinct(letters)
    return None


def _latin(labels: list[str]) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    found: list[str] = []
    for label in labels:
        if any(script_of(ch) not in (None, "Latin") for ch in label):
            continue
        others = [ch for ch in label if not ch.isascii()]
        # Compatibility forms are the compatibility finding's; a letter that looks like no ASCII one (ç, ş, ß)
        # means the label does not read as an ASCII word.
        if others and all(looks_ascii(ch) and not is_ascii_compat(ch) for ch in others):
            found += others
    return (("ASCII", "Latin"), _distinct(found)) if found else None


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
            (LookAlikeKind.LATIN, _latin(labels)),
            (LookAlikeKind.COMPAT, _compat(labels)),
        )
        for kind, found in checks:
            if found is None or (kind, word) in seen:
                continue
            seen.add((kind, word))
            if len(listed) < MAX_WORDS:
                listed.append(LookAlike(kind=kind, word=show(word), scripts=found[0], foreign=found[1]))
    return tuple(listed), len(seen)
