"""What a pasted secret looks like: the mix-ups every platform's tokens share.

The platforms answer a wrong token with a bare "invalid_auth" or 401; the
shape of what was pasted usually says exactly what went wrong. Each platform's
own judges (a user token in the bot token's place, a prefix copied with the
token) are its registry entry's (``kazma.config.registry.<platform>``), built
on :func:`pasted_badly`. Only shapes are judged; whether the platform accepts
the token is for ``kazma doctor`` to ask.
"""

from __future__ import annotations

import re
from typing import Final

_SPACE: Final = re.compile(r"\s")


def pasted_badly(value: str) -> str | None:
    """Spaces, a line break or quotes around a token: one sentence naming the fix, or None."""
    if _SPACE.search(value):
        return "contains spaces or a line break: copy it again, without anything around it"
    if value[:1] in "'\"<":
        return "starts with a quote or '<': write the token alone (YAML quotes are not part of it)"
    return None
