"""``kazma.config.store``: the storage layer, on SQLite or PostgreSQL.

Opening a store and applying each component's migrations (``database``, ``pg_schema``), the group-committing
writers (``writer`` on SQLite, ``postgres`` on PostgreSQL, both over ``group_commit``), the one table-access
protocol (``backend``, with ``pg_tables``), store failures as one exception family (``errors``), ``LISTEN``/
``NOTIFY`` (``pg_listen``), the leader lease (``leader``) and who is alive (``replicas``).

It sits below the configuration models and never imports them (a contract in ``pyproject.toml``): whoever
opens a store passes plain values (a path, a URL, a pool size), so the store can be used, tested and
benchmarked without a ``kazma.yaml``.
"""
