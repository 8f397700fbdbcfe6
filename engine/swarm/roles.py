"""Who may run which ``/swarm`` command.

Reading the swarm is open to anyone the platform lets talk to the bot; starting,
changing or steering work, showing the configuration and routing a result to
another chat need an operator. The check is pure so that every platform and
the CLI refuse the same people for the same reasons.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kazma.config.models import KazmaConfig
from kazma.config.registry import CHAT_PLATFORMS
from kazma.engine.swarm.syntax import Access, SwarmCommand

SHARED_OPERATORS_HINT = "tasks are not separated per user; set swarm.allow_shared_operators: true to allow it"


class Role(StrEnum):
    READER = "reader"  # anyone allowed to talk to the bot
    OPERATOR = "operator"  # a platform admin; for cli and web, an approver written for that platform


class RefusalReason(StrEnum):
    NOT_OPERATOR = "not_operator"
    SHARED_OPERATORS = "shared_operators"


@dataclass(frozen=True)
class Refusal:
    reason: RefusalReason
    message: str  # written for the person who typed the command

    def __str__(self) -> str:
        return self.message


def required_role(command: SwarmCommand) -> Role:
    """Reading needs nothing; everything else, and any route elsewhere, needs an operator."""
    if command.access is Access.READ and command.route is None:
        return Role.READER
    return Role.OPERATOR


def platform_operators(config: KazmaConfig, platform: str) -> frozenset[str]:
    """Actors (``platform:user``) who are operators on ``platform`` by configuration."""
    return config.roster.operators_for(platform)


def human_operators(config: KazmaConfig) -> frozenset[str]:
    """Every configured operator identity (see :meth:`Roster.human_operators`)."""
    return config.roster.human_operators()


def is_operator(*, actor: str, platform: str, is_admin: bool, config: KazmaConfig) -> bool:
    return config.roster.is_operator(actor, platform, is_admin=is_admin)


def authorize(
    command: SwarmCommand, *, actor: str, platform: str, is_admin: bool, config: KazmaConfig
) -> Refusal | None:
    """None when ``actor`` may run ``command`` on ``platform``; otherwise why not."""
    if required_role(command) is Role.READER:
        return None
    if not is_operator(actor=actor, platform=platform, is_admin=is_admin, config=config):
        return Refusal(RefusalReason.NOT_OPERATOR, _not_operator_message(command, actor, platform))
    if command.access is Access.STEER and not config.swarm.allow_shared_operators:
        count = len(human_operators(config))
        if count > 1:
            # One task list serves everyone: a second operator could cancel,
            # retry or approve the first one's work without either noticing.
            return Refusal(
                RefusalReason.SHARED_OPERATORS,
                f"/swarm {command.verb} is refused: {count} human operators are configured and {SHARED_OPERATORS_HINT}",
            )
    return None


# What each admin-only subcommand does, in the refusal a reader gets.
_ADMIN_DOES = {
    "config": "shows the swarm's settings",
    "breaker": "resets a worker's circuit breaker",
}


def _not_operator_message(command: SwarmCommand, actor: str, platform: str) -> str:
    if command.access is Access.STEER:
        what = f"/swarm {command.verb} starts, changes or steers work, so it"
    elif command.access is Access.ADMIN:
        what = f"/swarm {command.verb} {_ADMIN_DOES.get(command.verb, 'is for admins')}, so it"
    else:
        what = f"sending the result of /swarm {command.verb} to {command.route}"
    if platform in CHAT_PLATFORMS:
        who, where = f"a {platform} admin", f"platforms.{platform}.admins"
    else:
        who, where = f"an approver for {platform}", "approvals.approvers"
    return f"{what} needs {who}; {actor} is not one (operators are listed in {where})"
