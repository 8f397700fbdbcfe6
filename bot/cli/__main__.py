"""``python -m kazma.bot.cli``: the same command line as ``kazma``."""

from kazma.bot.cli import main

main()
