"""Telegram on python-telegram-bot: ``adapter.py`` (transport), ``render.py`` (HTML cards), ``errors.py``."""

from kazma.adapters.telegram.adapter import TelegramAdapter

__all__ = ["TelegramAdapter"]
