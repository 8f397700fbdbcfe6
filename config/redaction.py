"""What never reaches a log line or a person's screen: platform tokens by their shape, and registered secrets.

Below the log setup (``kazma.bot.logging`` runs every event through :func:`redact`) so that a platform's own
doctor check (``kazma.adapters.<platform>.doctor``) redacts what a platform answers with the same rules.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

from kazma.config.registry import CHAT_PLATFORMS

if TYPE_CHECKING:
    from kazma.config.models import KazmaConfig

# Token shapes that libraries may log inside URLs or error texts, as each platform's registry entry describes
# them. Secrets with no recognisable shape (some platforms', model keys) are added at start with
# :func:`redact_secret`.
_TOKEN_SHAPES: Final = re.compile(
    "|".join(spec.log_token_pattern for spec in CHAT_PLATFORMS.values() if spec.log_token_pattern) or "(?!)"
)
_REDACTED: Final = "<redacted>"
_secrets: set[str] = set()


def redact_secret(value: str) -> None:
    """Never write ``value`` to the log (a token whose shape the patterns do not know). Short values are ignored:
    replacing a three-letter word everywhere would garble the log and protect nothing."""
    if len(value) >= 8:
        _secrets.add(value)


def redact_config_secrets(config: KazmaConfig) -> None:
    """Every secret a configuration holds, whatever its shape: tokens, signing secrets, the model's key, the audit
    webhook's URL and headers."""
    for value in (
        *(secret for spec in CHAT_PLATFORMS.values() for secret in spec.secret_values(config.platforms)),
        config.model.api_key,
        config.store.secret,  # the password inside a postgresql:// store.url
        *(config.audit.sink.secrets() if config.audit.sink is not None else ()),  # a webhook's URL and headers
    ):
        if value:
            redact_secret(value)


def redact(text: str) -> str:
    for secret in _secrets:
        text = text.replace(secret, _REDACTED)
    return _TOKEN_SHAPES.sub(_REDACTED, text)
