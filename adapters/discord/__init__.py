"""Discord on discord.py: ``adapter.py`` (transport), ``render.py`` (embeds), ``errors.py``."""

from kazma.adapters.discord.adapter import DiscordAdapter

__all__ = ["DiscordAdapter"]
