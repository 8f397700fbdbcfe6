"""The installed distribution's version."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kazma")
except PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0.0.0+unknown"
