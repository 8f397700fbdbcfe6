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
from kazma.engine.swarm.grammar import Access, SwarmCommand

# The platforms whose admins are listed under platforms.<name>.admins; cli and
# web have no such list, so their operators are the approvers written for them.
_ADMIN_PLATFORMS = ("telegram", "slack", "discord")

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
    if platform == "telegram":
        return frozenset(f"telegram:{uid}" for uid in config.platforms.telegram.admins)
    if platform == "slack":
        return frozenset(f"slack:{uid}" for uid in config.platforms.slack.admins)
    if platform == "discord":
        return frozenset(f"discord:{uid}" for uid in config.platforms.discord.admins)
    # Approvers for other platforms must not leak in: approvers_for filters by prefix.
    return config.approvers_for(platform)


def human_operators(config: KazmaConfig) -> frozenset[str]:
    """Every configured operator identity: platform admins and approvers.

    Identities are ``platform:user`` strings and nothing links two of them, so a
    person who is an admin on Telegram and on Slack counts as two operators.
    Erring towards "more than one" only makes the shared-operator refusal
    stricter, never looser.
    """
    people = set(config.approvals.approvers)
    for platform in _ADMIN_PLATFORMS:
        people |= platform_operators(config, platform)
    return frozenset(people)


def is_operator(*, actor: str, platform: str, is_admin: bool, config: KazmaConfig) -> bool:
    if is_admin:
        return True
    # An actor is an operator only on the platform its id belongs to: a Slack
    # admin id typed into the CLI proves nothing.
    return actor.split(":", 1)[0] == platform and actor in platform_operators(config, platform)


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


def _not_operator_message(command: SwarmCommand, actor: str, platform: str) -> str:
    if command.access is Access.STEER:
        what = f"/swarm {command.verb} starts, changes or steers work, so it"
    elif command.access is Access.ADMIN:
        what = f"/swarm {command.verb} shows the swarm's settings, so it"
    else:
        what = f"sending the result of /swarm {command.verb} to {command.route}"
    if platform in _ADMIN_PLATFORMS:
        who, where = f"a {platform} admin", f"platforms.{platform}.admins"
    else:
        who, where = f"an approver for {platform}", "approvals.approvers"
    return f"{what} needs {who}; {actor} is not one (operators are listed in {where})"
