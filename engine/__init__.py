"""``kazma.engine``: agents, model providers, tools, plans and the swarm."""
