"""``kazma.bot.console``: the web server — console, approval pages, dashboard, metrics."""
