"""Slack on slack-bolt and slack-sdk: ``adapter.py`` (transport), ``render.py`` (blocks), ``errors.py``."""

from kazma.adapters.slack.adapter import SlackAdapter

__all__ = ["SlackAdapter"]
