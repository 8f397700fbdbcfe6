"""One backoff rule for every retry in Kazma: capped exponential growth with "equal jitter".

The delay before retry ``n`` (0-based) is ``min(cap, base * 2**n)``, scaled
into ``[delay/2, delay]`` when jitter is on, so callers that failed together
do not retry together while waits still grow. A server's own ``retry_after``
wins when it is longer.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

_MAX_EXPONENT = 30  # 2**30 times any sane base is past every cap; keeps the float finite


@dataclass(frozen=True)
class Backoff:
    base: float = 0.5
    cap: float = 60.0
    jitter: bool = True
    rng: Callable[[], float] = field(default=random.random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.base <= 0 or self.cap < self.base:
            raise ValueError(f"backoff needs 0 < base <= cap, got base={self.base}, cap={self.cap}")

    def ceiling(self, retry: int) -> float:
        """The nominal (jitter-free) delay before retry ``retry``."""
        return min(self.cap, self.base * 2.0 ** min(max(retry, 0), _MAX_EXPONENT))

    def delay(self, retry: int, *, retry_after: float | None = None) -> float:
        nominal = self.ceiling(retry)
        if self.jitter:
            nominal *= 0.5 + 0.5 * min(1.0, max(0.0, self.rng()))
        return max(nominal, retry_after or 0.0)
