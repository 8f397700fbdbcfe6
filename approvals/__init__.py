"""``kazma.approvals``: approval requests, the one-decision store, cards and the safety policy."""
