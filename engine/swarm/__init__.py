"""``kazma.engine.swarm``: swarm patterns, the task store, reliability, the ``/swarm`` grammar, roles and commands.

The swarm sits above the rest of the engine: it runs agents as workers, and
nothing below it imports it (a layers contract keeps it that way).
"""
