"""``kazma.adapters``: the bus contract and the platform adapters."""
