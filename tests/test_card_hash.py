"""The card hash, as a client in another language makes it: the README's words, the test vector, and an
encoder written from those words alone (no ``json`` module) that agrees with Kazma's on any arguments."""

from __future__ import annotations

import hashlib
import json
import math
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kazma.approvals.client import canonical_hash
from kazma.approvals.hashing import args_hash, canonical_json
from kazma.bot.console.api import openapi_document
from kazma.bot.console.api_models import HASH_RULE

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = (
    README.read_text(encoding="utf-8").split("**The hash, from any language.**", 1)[1].split("\n\nA request", 1)[0]
)


def _vector() -> tuple[str, str, str]:
    sent, canonical = re.findall(r"```(?:json|text)\n(.*?)\n```", SECTION, flags=re.DOTALL)
    (digest,) = re.findall(r"the hash `([0-9a-f]{64})`", SECTION)
    return sent, canonical, digest


def test_the_readme_vector_is_what_kazma_computes() -> None:
    sent, canonical, digest = _vector()
    arguments = json.loads(sent)  # as the API parses a body: 1.0 and 1e16 are doubles, 12345… an integer
    assert canonical_json(arguments) == canonical
    assert args_hash(arguments) == canonical_hash(arguments) == digest
    assert hashlib.sha256(canonical.encode("utf-8")).hexdigest() == digest
    # the vector shows where code-point order and RFC 8785's UTF-16 order differ
    assert canonical.index('"～"') < canonical.index('"😀"')


def test_the_openapi_document_names_the_rule_on_hash() -> None:
    approval = openapi_document()["components"]["schemas"]["Approval"]
    assert approval["properties"]["hash"]["description"] == HASH_RULE
    for words in ("sort_keys=True", "code point", "\\u00xx", "repr of a double", "1e2 hashes as 100.0", "-4 to 15"):
        assert words in HASH_RULE, words
    words = " ".join(SECTION.split())
    assert "code point" in words
    assert "1e2` hashes as `100.0`" in words
    assert "-4 to 15" in words


# -- an encoder from the documented rules alone ----------------------------------------------------------------

_SHORT = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _string(text: str) -> str:
    out = []
    for char in text:
        if char in _SHORT:
            out.append(_SHORT[char])
        elif ord(char) < 0x20:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _shortest(value: float) -> str:
    """d.ddde±X: the fewest digits that read back as ``value``, the one nearest it when several do (at the
    precision found, the correctly rounded candidate or a neighbour one unit away in its last digit)."""
    exact = Decimal(value)
    for precision in range(1, 18):
        rounded = Decimal(f"{value:.{precision - 1}e}")
        unit = Decimal(1).scaleb(rounded.adjusted() - precision + 1)
        fits = [c for c in (rounded, rounded - unit, rounded + unit) if float(c) == value]
        if fits:
            best = min(fits, key=lambda c: abs(c - exact))
            return f"{best:.{precision - 1}e}"
    raise AssertionError(value)


def _number(value: float) -> str:
    """The documented form without Python's repr: the fewest significant digits that read back the same value;
    positional when the decimal exponent is from -4 to 15 (always with a '.'), else d.ddde±XX."""
    assert math.isfinite(value)
    shortest = _shortest(value)
    mantissa, exponent_text = shortest.split("e")
    negative = mantissa.startswith("-")
    digits = mantissa.lstrip("-").replace(".", "").rstrip("0") or "0"
    exponent = int(exponent_text)
    sign = "-" if negative else ""
    if -4 <= exponent < 16:
        if exponent >= 0:
            whole = digits[: exponent + 1].ljust(exponent + 1, "0")
            fraction = digits[exponent + 1 :] or "0"
        else:
            whole, fraction = "0", "0" * (-exponent - 1) + digits
        return f"{sign}{whole}.{fraction}"
    rest = f".{digits[1:]}" if len(digits) > 1 else ""
    return f"{sign}{digits[0]}{rest}e{'-' if exponent < 0 else '+'}{abs(exponent):02d}"


def documented(value: Any) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list):
        return "[" + ",".join(documented(v) for v in value) + "]"
    assert isinstance(value, dict)
    keys = sorted(value, key=lambda k: [ord(c) for c in k])  # by code point
    return "{" + ",".join(f"{_string(k)}:{documented(value[k])}" for k in keys) + "}"


_TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)
_LEAF = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _TEXT
_VALUES = st.recursive(_LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4))


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_TEXT, _VALUES, max_size=6))
def test_an_encoder_written_from_the_readme_agrees_with_kazma(arguments: dict[str, Any]) -> None:
    expected = canonical_json(arguments)
    assert documented(arguments) == expected
    assert hashlib.sha256(expected.encode("utf-8")).hexdigest() == args_hash(arguments)
