"""Matrix on mautrix: one bot account on a homeserver, cards as formatted messages, presses as reactions."""

from kazma.adapters.matrix.adapter import MatrixAdapter

__all__ = ["MatrixAdapter"]
