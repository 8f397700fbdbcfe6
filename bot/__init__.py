"""``kazma.bot``: the composition root, the CLI and inbound routing."""
