"""Who is at the command line: ``cli:<login>``, where the login is the system user running the command.

What it proves: that whoever typed the command could run ``kazma`` as that system user — with the store and
the decision key in reach, so no more than shell access as that user proves. ``people:`` says whose the
login is (``alice: {cli: alice}``), and a decision made here records that person.

``--as NAME`` no longer names anyone: it only *confirms* who you are (your login, or the person it belongs
to) and a command that claims someone else is refused. A team that shares one system account for Kazma may
set ``approvals.cli_identity: declared``: then ``--as LOGIN`` is taken as typed (the system user without
it), as before people were recorded — it proves nothing beyond that shared account, and the README says so.
"""

from __future__ import annotations

import getpass
import os

import click

from kazma.config.address import Actor
from kazma.config.models import KazmaConfig
from kazma.config.registry import user_id_problem


def system_login() -> str:
    """The system user running this process (by its user id, not by what ``$USER`` says)."""
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):  # no password database entry (a bare container): the login name
        return getpass.getuser()


def cli_login(config: KazmaConfig, claimed: str | None) -> str:
    """The login to record as ``cli:<login>``; raises ``click.UsageError`` when ``--as`` claims someone else."""
    if config.approvals.cli_identity == "declared" and claimed:
        problem = user_id_problem("cli", claimed)
        if problem is not None:
            raise click.UsageError(f"--as {claimed!r}: {problem}")
        return claimed
    login = system_login()
    person = config.people.person_of(str(Actor("cli", login)))
    if claimed is None or claimed in (login, person):
        return login
    known = f" ({person})" if person else ""
    raise click.UsageError(
        f"you are cli:{login}{known} on this machine: --as {claimed} would be someone else. The command line "
        "records the system user running it; --as only confirms who that is (approvals.cli_identity: system)"
    )
