"""The one ``@name`` rule, as cases every door is held to: the three chat platforms (the contract) and the console.

The console once had a rule of its own that called ``@2bot``, ``x.@builder``, ``@everyone`` and a name inside a
code span an agent's name; each case here is one of those disagreements, and the last is what every door reads.
"""

from __future__ import annotations

from typing import Final

MENTION_CASES: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("@2bot look at this", ()),  # a name starts with a letter
    ("ask x.@builder about it", ()),  # inside a word or a dotted name
    ("@everyone @here @channel look", ()),  # mass mentions are nobody's name
    ("run `@builder` literally", ()),  # a code span is text, not a call
    ("mail ops@builder.example today", ()),  # an address
    ("please @Builder ask @researcher and @builder", ("builder", "researcher")),  # once each, in order
)
