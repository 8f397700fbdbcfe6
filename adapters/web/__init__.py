"""The web console as a platform: ``adapter.py`` (conversations, cards, presses), ``render.py`` (HTML cards)."""

from kazma.adapters.web.adapter import CONSOLE, WebAdapter, WebMessage

__all__ = ["CONSOLE", "WebAdapter", "WebMessage"]
