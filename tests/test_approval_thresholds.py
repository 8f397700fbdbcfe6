"""Approval policies: several people decide one call, each review on the record, the outcome set once.

What is attacked: a second press by the same person on another platform counting as a second person; a
third or fourth approval after the threshold adding reviews or a second outcome; an approval arriving after a
denial that reached its threshold; the requester approving their own call; an Approve without a passkey on a
step-up policy; a remembered approval standing in for two people; an approved row without its reviews running.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kazma.approvals import (
    MIGRATIONS,
    ApprovalRefused,
    ApprovalService,
    ApprovalStore,
    Decision,
    ExecutionMismatch,
    PressVerdict,
    SafetyPolicy,
    Status,
)
from kazma.approvals.rules import MIGRATIONS as RULES
from kazma.approvals.rules import RuleStore
from kazma.approvals.service import CardLocation
from kazma.approvals.waiting import WaitingForYou
from kazma.approvals.withdrawal import Gone
from kazma.config import ConfigError, load_config_text
from kazma.config.store.database import open_database
from tests.approvals_support import TEST_KEYRING, ManualClock, RecordingPublisher, approval_service
from tests.policy_support import ALICE_ON_SLACK, POLICY_PEOPLE_YAML, policy_config
from tests.store_backends import Engine


def _problem(text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config_text(text)
    return str(caught.value)


# -- configuration ---------------------------------------------------------------------------------------


def test_tools_pick_policies_and_everything_else_keeps_todays_rule() -> None:
    config = policy_config()
    assert config.policy_name_for("shell") == "two"
    assert config.policy_name_for("deploy/rollout") == "passkey"  # an MCP server's tools by server/*
    assert config.policy_name_for("write_file") == "default"
    default = config.policy("default")
    assert default is not None
    assert (default.approve, default.deny, default.step_up) == (1, 1, False)
    assert str(config.danger_level("shell")) == "dangerous"


@pytest.mark.parametrize(
    ("policies", "key", "said"),
    [
        ("three: {approve: 3, approvers: [alice, bob]}", "approvals.policies.three.approve", "only 2 people"),
        ("nay: {deny: 6}", "approvals.policies.nay.deny", "only 5 people"),
        ("pk: {step_up: true, approvers: [dave, erin]}", "approvals.policies.pk.step_up", "web account"),
        ("who: {approvers: [zed]}", "approvals.policies.who.approvers[0]", "unknown person or group"),
    ],
)
def test_a_policy_that_can_never_be_met_is_a_config_error_naming_its_key(policies: str, key: str, said: str) -> None:
    text = POLICY_PEOPLE_YAML.replace("  policies:\n", f"  policies:\n    {policies}\n", 1)
    problem = _problem(text)
    assert key in problem, problem
    assert said in problem, problem


def test_an_api_tokens_owner_is_one_person_never_a_group() -> None:
    """forbid_requester refuses the token owner's Approve; a group's name is nobody's, so a group as owner forbade
    nobody (alice, in the group, approved what her team's token asked). A configuration error now, naming the key."""
    groups = POLICY_PEOPLE_YAML.replace(
        '  erin: {discord: "222222222222222222"}\n',
        '  erin: {discord: "222222222222222222"}\n  groups:\n    ops: [alice, bob]\n',
    )
    token = "t" * 40
    problem = _problem(groups + f"api:\n  tokens:\n    ci: {{token: {token}, owner: ops}}\n")
    assert "api.tokens.ci.owner" in problem, problem
    assert "'ops' is a group" in problem, problem
    for owner in ("alice", "'telegram:111'"):  # a person, or an identity: still fine
        load_config_text(groups + f"api:\n  tokens:\n    ci: {{token: {token}, owner: {owner}}}\n")


def test_a_tool_naming_an_unknown_policy_or_a_read_level_is_refused() -> None:
    assert "tools.shell.policy" in _problem("tools:\n  shell: {policy: nope}\n")
    problem = _problem(POLICY_PEOPLE_YAML.replace("shell: {policy: two}", "read_file: {level: read, policy: two}"))
    assert "tools.read_file.level" in problem
    assert "only a dangerous tool" in problem


# -- reviews and thresholds ------------------------------------------------------------------------------


async def test_two_people_decide_and_the_same_person_on_two_platforms_counts_once(tmp_path: Path) -> None:
    publisher = RecordingPublisher()
    async with approval_service(tmp_path / "k.db", config=policy_config(), publisher=publisher) as service:
        request = await service.open("shell", {"command": "rm -rf build"}, "agent:builder", "telegram:-100")
        assert (request.policy, request.approve_needed, request.deny_needed) == ("two", 2, 1)

        first = await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        assert first.verdict is PressVerdict.COUNTED
        assert "1 of 2 approvals: alice on Telegram" in first.message
        assert "waiting for: bob, carol, dave, erin" in first.message
        again = await service.decide(request.id, Decision.APPROVE, actor=ALICE_ON_SLACK[0], platform="slack")
        assert again.verdict is PressVerdict.REPEATED  # alice on Slack is still alice
        assert (await service.store.get(request.id)).status is Status.PENDING  # type: ignore[union-attr]

        second = await service.decide(request.id, Decision.APPROVE, actor="telegram:333", platform="telegram")
        assert second.verdict is PressVerdict.WON
        late = await service.decide(request.id, Decision.APPROVE, actor="slack:U0CAROL01", platform="slack")
        assert late.verdict is PressVerdict.LOST

        row = await service.store.get(request.id)
        assert row is not None
        assert row.status is Status.APPROVED
        assert (row.decided_by, row.decided_person) == ("telegram:333", "bob")  # the review that crossed it
        reviews = await service.store.reviews(request.id)
        assert [(r.reviewer, r.actor) for r in reviews] == [("alice", "telegram:111"), ("bob", "telegram:333")]
        events = [e.event for e in await service.store.events(request.id)]
        assert events.count("decided") == 1
        assert events.count("reviewed") == 1
        assert "review_repeated" in events
        assert "press_lost" in events
        await service.verify_execution(request.id, "shell", {"command": "rm -rf build"})  # two people: runs
        # Every ending Kazma wrote reads as its own to the audit's row check (a decision by the review that crossed
        # the threshold, a denial by one of two, a withdrawal): none is said to be a row changed around Kazma.
        denied = await service.open("shell", {"command": "rm -rf /"}, "agent:builder", "telegram:-100")
        assert (await service.decide(denied.id, Decision.DENY, actor="telegram:111", platform="telegram")).won
        withdrawn = await service.open("shell", {"command": "true"}, "agent:builder", "telegram:-100")
        assert (await service.withdraw(withdrawn.id, Gone.CANCELLED))[0]
        assert await service.store.unrecorded_requests() == ([], False)


# An identity that decided while nobody's (a raw approver), linked to alice afterwards: one more door of hers.
_UNLINKED = POLICY_PEOPLE_YAML.replace(
    "approvers: [alice, bob, carol, dave, erin]", "approvers: [alice, bob, carol, dave, erin, 'telegram:999']"
)
_LINKED = _UNLINKED.replace("alice: {telegram: 111,", "alice: {telegram: [111, 999],")


async def test_an_identity_linked_to_its_person_after_it_reviewed_counts_for_that_person_once(
    store_engine: Engine,
) -> None:
    """A request waits across a restart (an API call's does); meanwhile people: links telegram:999 to alice. Her
    press on another door is her second review, not a second person's: the call still waits for someone else."""
    unlinked, linked = load_config_text(_UNLINKED).config, load_config_text(_LINKED).config
    async with approval_service(store_engine.where, config=unlinked, publisher=RecordingPublisher()) as service:
        request = await service.open("shell", {"command": "rm -rf /srv"}, "agent:b", "telegram:-100", durable=True)
        first = await service.decide(request.id, Decision.APPROVE, actor="telegram:999", platform="telegram")
        assert first.verdict is PressVerdict.COUNTED
    async with approval_service(store_engine.where, config=linked, publisher=RecordingPublisher()) as service:
        progress = await service.progress(request.id)
        assert progress is not None
        assert "alice" not in progress.waiting_for  # her review is in, made on the door linked to her since
        for actor, platform in (("telegram:111", "telegram"), ALICE_ON_SLACK):
            again = await service.decide(request.id, Decision.APPROVE, actor=actor, platform=platform)
            assert again.verdict is PressVerdict.REPEATED, (actor, again.message)
        assert (await service.store.get(request.id)).status is Status.PENDING  # type: ignore[union-attr]
        waiting = await WaitingForYou(service).for_actor("slack:U0ALICE01")
        assert [w.request.id for w in waiting.items] == []  # nothing waits for her: she reviewed it
        assert [w.request.id for w in (await WaitingForYou(service).for_actor("telegram:333")).items] == [request.id]
        second = await service.decide(request.id, Decision.APPROVE, actor="telegram:333", platform="telegram")
        assert second.verdict is PressVerdict.WON  # bob: the second person
        reviews = await service.store.reviews(request.id)
        assert [(r.reviewer, r.actor) for r in reviews] == [("telegram:999", "telegram:999"), ("bob", "telegram:333")]


_THREE_UNLINKED = POLICY_PEOPLE_YAML.replace(
    "approvers: [alice, bob, carol, dave, erin]",
    "approvers: [alice, bob, carol, dave, erin, 'telegram:998', 'telegram:999']",
).replace("two: {approve: 2}", "two: {approve: 3}")
_THREE_LINKED = _THREE_UNLINKED.replace("alice: {telegram: 111,", "alice: {telegram: [111, 998, 999],")


async def test_the_progress_counts_reviews_by_person_as_the_store_does(store_engine: Engine) -> None:
    """Two identities reviewed while nobody's, both linked to alice since: the store counts them as one person,
    so bob's approval is the second of three. The card and bob's answer said "3 of 3 approvals" (one per review
    row) while the call still waited for a third person."""
    unlinked, linked = load_config_text(_THREE_UNLINKED).config, load_config_text(_THREE_LINKED).config
    async with approval_service(store_engine.where, config=unlinked, publisher=RecordingPublisher()) as service:
        request = await service.open("shell", {"command": "rm -rf /srv"}, "agent:b", "telegram:-100", durable=True)
        for actor in ("telegram:998", "telegram:999"):
            pressed = await service.decide(request.id, Decision.APPROVE, actor=actor, platform="telegram")
            assert pressed.verdict is PressVerdict.COUNTED
    async with approval_service(store_engine.where, config=linked, publisher=RecordingPublisher()) as service:
        progress = await service.progress(request.id)
        assert progress is not None
        assert progress.line().startswith("1 of 3 approvals: alice on Telegram;"), progress.line()
        bobs = await service.decide(request.id, Decision.APPROVE, actor="telegram:333", platform="telegram")
        assert bobs.verdict is PressVerdict.COUNTED
        assert "2 of 3 approvals: alice on Telegram, bob on Telegram;" in bobs.message, bobs.message
        assert (await service.store.get(request.id)).status is Status.PENDING  # type: ignore[union-attr]
        progress = await service.progress(request.id)
        assert progress is not None
        assert progress.approvals == ("alice on Telegram", "bob on Telegram")


async def test_a_denial_reaching_its_threshold_wins_over_later_approvals(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db", config=policy_config(), publisher=RecordingPublisher()) as service:
        request = await service.open("shell", {"command": "deploy"}, "agent:builder", "telegram:-100")
        await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        denied = await service.decide(
            request.id, Decision.DENY, actor="telegram:444", platform="telegram", reason="not on a Friday"
        )
        assert denied.verdict is PressVerdict.WON  # deny: 1 by default
        after = await service.decide(request.id, Decision.APPROVE, actor="telegram:333", platform="telegram")
        assert after.verdict is PressVerdict.LOST
        row = await service.store.get(request.id)
        assert row is not None
        assert (row.status, row.reason) == (Status.DENIED, "not on a Friday")

        vetoed = await service.open("shell", {"command": "x"}, "agent:b", "telegram:-100", policy="veto-two")
        one = await service.decide(vetoed.id, Decision.DENY, actor="telegram:111", platform="telegram")
        assert one.verdict is PressVerdict.COUNTED
        assert "1 of 2 denials: alice on Telegram" in one.message
        two = await service.decide(vetoed.id, Decision.DENY, actor="telegram:333", platform="telegram")
        assert two.verdict is PressVerdict.WON
        assert (await service.store.get(vetoed.id)).status is Status.DENIED  # type: ignore[union-attr]


async def test_forbid_requester_refuses_the_requesters_approve_on_every_door(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db", config=policy_config(), publisher=RecordingPublisher()) as service:
        request = await service.open(
            "shell", {"command": "x"}, "agent:b", "telegram:-100", policy="two-no-self", started_by="telegram:111"
        )
        for actor, platform in (("telegram:111", "telegram"), ALICE_ON_SLACK):  # alice asked, on any door
            refused = await service.decide(request.id, Decision.APPROVE, actor=actor, platform=platform)
            assert refused.verdict is PressVerdict.REFUSED
            assert "You asked for this call" in refused.message
        assert await service.store.reviews(request.id) == []
        progress = await service.progress(request.id)
        assert progress is not None
        assert "alice" not in progress.waiting_for
        refusals = await service.store.events(request.id, event="press_refused")
        assert refusals
        assert "forbid_requester" in (refusals[0].detail or "")
        # her own Deny still counts: withdrawing what you asked for needs nobody else
        denied = await service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")
        assert denied.verdict is PressVerdict.WON


async def test_step_up_approves_only_with_a_passkey_and_deny_stays_one_press(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db", config=policy_config(), publisher=RecordingPublisher()) as service:
        request = await service.open("deploy/rollout", {"env": "prod"}, "agent:b", "telegram:-100")
        assert request.step_up
        assert request.policy == "passkey"
        for actor, platform in (("telegram:111", "telegram"), ("web:alice", "web")):
            refused = await service.decide(request.id, Decision.APPROVE, actor=actor, platform=platform)
            assert refused.verdict is PressVerdict.REFUSED
            assert "with your passkey" in refused.message
        won = await service.decide(request.id, Decision.APPROVE, actor="web:alice", platform="web", stepped_up=True)
        assert won.verdict is PressVerdict.WON

        other = await service.open("deploy/rollout", {"env": "staging"}, "agent:b", "telegram:-100")
        denied = await service.decide(other.id, Decision.DENY, actor="telegram:333", platform="telegram")
        assert denied.verdict is PressVerdict.WON


async def test_a_policys_approvers_replace_the_global_list(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db", config=policy_config(), publisher=RecordingPublisher()) as service:
        request = await service.open("shell", {"c": 1}, "agent:b", "telegram:-100", policy="ops-only")
        refused = await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        assert refused.verdict is PressVerdict.REFUSED
        assert "not an approver" in refused.message
        won = await service.decide(request.id, Decision.APPROVE, actor="telegram:444", platform="telegram")
        assert won.verdict is PressVerdict.WON
        await service.verify_execution(request.id, "shell", {"c": 1})


async def test_an_unknown_policy_is_refused_before_anything_is_opened(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db", config=policy_config(), publisher=RecordingPublisher()) as service:
        with pytest.raises(ApprovalRefused, match="unknown approvals policy 'nope'"):
            await service.open("shell", {}, "agent:b", "telegram:-100", policy="nope")
        assert await service.store.requests() == []


async def test_an_approval_without_its_reviews_on_record_does_not_run(tmp_path: Path) -> None:
    """A row set approved by one statement (no reviews: written outside the review path) never runs."""
    async with approval_service(tmp_path / "k.db", config=policy_config(), publisher=RecordingPublisher()) as service:
        request = await service.open("shell", {"command": "x"}, "agent:b", "telegram:-100")
        won, _ = await service.store.finish(request.id, Status.APPROVED, actor="telegram:333", platform="telegram")
        assert won
        await service.store.audit(request.id, "decided", actor="telegram:333", platform="telegram", detail="approved",
                                  person="bob")  # fmt: skip
        with pytest.raises(ExecutionMismatch, match="0 approving reviews on record"):
            await service.verify_execution(request.id, "shell", {"command": "x"})


async def test_remembered_approvals_never_stand_for_a_policy_of_two(tmp_path: Path) -> None:
    text = POLICY_PEOPLE_YAML.replace("  policies:\n", "  remember: {enabled: true}\n  policies:\n", 1)
    config = load_config_text(text).config
    clock = ManualClock()
    conn = await open_database(tmp_path / "k.db", busy_timeout_ms=5000, migrations=[*MIGRATIONS, *RULES])
    rules = RuleStore(conn, clock=clock)
    publisher = RecordingPublisher()
    s = ApprovalService(
        ApprovalStore(conn, clock=clock, keyring=TEST_KEYRING), config, publisher=publisher, clock=clock,
        poll_interval=0.02, rules=rules,
    )  # fmt: skip
    try:
        request = await s.open("shell", {"command": "ls"}, "agent:b", "telegram:-100")
        assert s.card(request).remember_seconds is None  # no "Approve for 1 h" button on its cards
        await s.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        remember = await s.decide(
            request.id,
            Decision.APPROVE,
            actor="telegram:333",
            platform="telegram",
            remember=True,
            card=CardLocation(None, None),
        )
        assert remember.verdict is PressVerdict.REFUSED
        assert "cannot be remembered" in remember.message
        # A rule on record for exactly this call (made while shell was one press) is not consulted now.
        single = await s.open("write_file", {"path": "a"}, "agent:b", "telegram:-100")
        await s.decide(single.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        await rules.add(
            tool="shell", args_hash=request.args_hash, conversation="telegram:-100", created_by="telegram:111",
            created_via="telegram", request_id=single.id, seconds=600,
        )  # fmt: skip
        before = len(publisher.published)
        checking = asyncio.create_task(
            SafetyPolicy(s).check("shell", {"command": "ls"}, requested_by="agent:b", conversation="telegram:-100")
        )
        async with asyncio.timeout(10):
            while len(publisher.published) == before:  # a card: no rule stood in for two people
                await asyncio.sleep(0.01)
        checking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await checking
        assert await s.store.events(event="rule_used") == []
    finally:
        await conn.close()


# The same people, with alice no longer among the approvers of "two" (the configuration changed while a request
# waited); and with "two" forbidding the requester's approval.
_TWO_WITHOUT_ALICE = POLICY_PEOPLE_YAML.replace("two: {approve: 2}", "two: {approve: 2, approvers: [bob, carol, dave]}")
_TWO_NO_SELF = POLICY_PEOPLE_YAML.replace("two: {approve: 2}", "two: {approve: 2, forbid_requester: true}")


@pytest.mark.parametrize("after", [_TWO_WITHOUT_ALICE, _TWO_NO_SELF], ids=["not-an-approver", "the-requester"])
async def test_a_review_the_changed_policy_would_refuse_does_not_count_toward_its_threshold(
    store_engine: Engine, after: str
) -> None:
    """alice approves; kazma.yaml then takes her out of the policy's approvers (or forbids the requester, and she
    asked for the call) and Kazma restarts. Bob's approval was counted as the second and set "approved", which
    the check before the call runs (reviews weighed under the configuration now) then called a forgery: told
    "Approved", the call never ran. Her review no longer counts: the request waits for a second person."""
    before = load_config_text(POLICY_PEOPLE_YAML).config
    async with approval_service(store_engine.where, config=before, publisher=RecordingPublisher()) as service:
        request = await service.open(
            "shell", {"command": "rm -rf /srv"}, "agent:b", "telegram:-100", durable=True, started_by="alice"
        )
        first = await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        assert first.verdict is PressVerdict.COUNTED
    changed = load_config_text(after).config
    async with approval_service(store_engine.where, config=changed, publisher=RecordingPublisher()) as service:
        second = await service.decide(request.id, Decision.APPROVE, actor="telegram:333", platform="telegram")
        assert second.verdict is PressVerdict.COUNTED, second.message
        assert "1 of 2 approvals: bob on Telegram" in second.message
        assert (await service.store.get(request.id)).status is Status.PENDING  # type: ignore[union-attr]
        third = await service.decide(request.id, Decision.APPROVE, actor="slack:U0CAROL01", platform="slack")
        assert third.verdict is PressVerdict.WON
        await service.verify_execution(request.id, "shell", {"command": "rm -rf /srv"})  # bob and carol: runs
