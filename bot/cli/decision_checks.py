"""``kazma doctor``'s checks of the decision seals: the key is there and out of reach, and every seal verifies.

A decided row whose seal does not verify was written outside Kazma (or sealed with a key that is not held
here): an approval among them will never run, and someone could write the store. Rows decided before Kazma
sealed decisions have no seal; they are history, and can never run either.
"""

from __future__ import annotations

from kazma.approvals.audit_verify import CHAINED_UNSEALED
from kazma.approvals.checkpoints import HISTORY
from kazma.approvals.model import ApprovalRequest
from kazma.approvals.seal import KEY_UNKNOWN, seal_problem
from kazma.approvals.store import ApprovalStore, UnreadableRequest
from kazma.bot.cli.checks import Check, Level
from kazma.bot.cli.key_checks import key_file_problem, replicas_need_it
from kazma.bot.keys import decision_key_file, decision_keys_folder
from kazma.bot.store import store_for_command
from kazma.config import LoadedConfig
from kazma.config.keyring import DECISION_KEYS, KeyMissing, Keyring, KeyringError, read_keyring

KEY_CHECK = "decision key"
SEAL_CHECK = "decision seals"
_SHOWN = 5  # rows named in a failure; the count says how many in all
PAGE = 5000  # decided rows read at a time


async def check_decisions(loaded: LoadedConfig, *, store_ok: bool = True) -> list[Check]:
    """The decision key, then every seal in the store (when the store could be opened: the store's own check
    already says why not)."""
    if not store_ok:
        return [check_decision_key(loaded)]
    seals, sealed = await check_decision_seals(loaded)
    return [check_decision_key(loaded, sealed=sealed), seals]


def check_decision_key(loaded: LoadedConfig, *, sealed: int = 0) -> Check:
    """Present and readable, private, outside the store's folder and the workspaces; which key seals.

    ``sealed``: how many sealed decisions the store holds. Without a key they cannot be verified (approved
    ones will not run); with none, a SQLite Kazma that has not started yet simply has not made its key.
    """
    config = loaded.config
    path = decision_key_file(config)
    try:
        ring = read_keyring(DECISION_KEYS, decision_keys_folder(config))
    except KeyMissing as exc:
        if config.store.backend == "postgresql":
            return Check(KEY_CHECK, Level.FAIL, replicas_need_it(exc, DECISION_KEYS.env))
        if sealed:
            return Check(
                KEY_CHECK,
                Level.FAIL,
                f"{exc}, but the store holds {sealed} sealed decisions: it was removed or moved, and no approval "
                "can be verified (none will run); put it back, or set it in the environment",
            )
        return Check(KEY_CHECK, Level.OK, f"none yet: kazma run makes {path} at its first start (0600)")
    except KeyringError as exc:
        return Check(KEY_CHECK, Level.FAIL, f"unusable: {exc}; no approval can be sealed or verified")
    problem = key_file_problem(ring, config, power="can seal approvals")
    if problem is not None:
        return Check(KEY_CHECK, Level.FAIL, problem)
    detail = ring.describe()
    if ring.path is None and path.exists():
        detail += f" ({path} is not used while {DECISION_KEYS.env} is set)"
    if ring.path is not None and config.store.backend == "postgresql":
        detail += "; every replica needs this same file"
    return Check(KEY_CHECK, Level.OK, detail)


class _Named:
    """Rows found wrong, counted; only the first :data:`_SHOWN` kept to name (a bulk rewrite leaves many alike)."""

    def __init__(self) -> None:
        self.count = 0
        self.approved = 0
        self.shown: list[tuple[ApprovalRequest, str]] = []

    def add(self, row: ApprovalRequest, why: str) -> None:
        self.count += 1
        self.approved += row.status.value == "approved"
        if len(self.shown) < _SHOWN:
            self.shown.append((row, why))

    def __str__(self) -> str:
        shown = "; ".join(f"{r.id} ({r.status.value} by {r.decided_by}): {why}" for r, why in self.shown)
        more = f"; and {self.count - _SHOWN} more" if self.count > _SHOWN else ""
        return shown + more


def _keyring_or_none(loaded: LoadedConfig) -> Keyring | None:
    try:
        return read_keyring(DECISION_KEYS, decision_keys_folder(loaded.config))
    except KeyringError:
        return None


async def check_decision_seals(loaded: LoadedConfig) -> tuple[Check, int]:
    """Every decided row's seal, verified with the keys held here, a page at a time; and how many rows carry a
    seal."""
    keyring = _keyring_or_none(loaded)
    rows = historic = sealed = 0
    forged, unknown = _Named(), _Named()
    unreadable: list[UnreadableRequest] = []  # the first _SHOWN, named
    unreadable_count = 0
    retired: dict[str, int] = {}  # by key id: sealed with a key retired on purpose (history, not checked)
    try:
        async with store_for_command(loaded.config, read_only=True) as opened:
            store = ApprovalStore(opened, keyring=keyring)
            since = await store.sealed_since()
            first = await store.chain_checkpoints(0, limit=1)
            history = first[0].seq if first and first[0].kind == HISTORY else 0
            after = ""
            while True:
                page, bad = await store.decided_rows(after, limit=PAGE)
                if not page and not bad:
                    break
                unreadable_count += len(bad)
                unreadable += bad[: _SHOWN - len(unreadable)]
                # "Decided before seals" is the schema row's word, and that row is the store's too: a seal taken
                # off and the row moved read as history. The chain says better (seals came before it): only a
                # decision whose ending event was chained once at the upgrade (or not chained yet) can be unsealed.
                unsealed = [row.id for row in page if row.decision_mac is None]
                endings = await store.endings_of(unsealed) if unsealed else {}
                for row in page:
                    rows += 1
                    sealed += row.decision_mac is not None
                    decided = row.decided_at.timestamp() if row.decided_at is not None else None
                    if row.decision_mac is None and (since is None or (decided is not None and decided < since)):
                        seq, chained = endings.get(row.id, (0, False))
                        if not chained or seq <= history:
                            historic += 1  # decided before seals: history, and can never run
                        else:
                            forged.add(row, CHAINED_UNSEALED)
                        continue
                    problem = seal_problem(keyring, row)
                    if problem is None:
                        continue
                    if problem.retired and row.decision_key_id is not None:
                        retired[row.decision_key_id] = retired.get(row.decision_key_id, 0) + 1
                        continue
                    (unknown if problem.site == KEY_UNKNOWN else forged).add(row, problem.detail)
                nxt = store.page_end(page, bad)
                if nxt is None or nxt == after or len(page) + len(bad) < PAGE:
                    break
                after = nxt
    except Exception as exc:
        said = str(exc).strip() or type(exc).__name__
        return Check(SEAL_CHECK, Level.FAIL, f"cannot read the store: {said}"), 0
    if unreadable_count:
        # Its seal cannot be checked and none of it can run: a write around Kazma, named so it can be found.
        shown = "; ".join(f"{bad.request_id} ({', '.join(bad.columns)})" for bad in unreadable)
        more = f"; and {unreadable_count - _SHOWN} more" if unreadable_count > _SHOWN else ""
        also = f"; of the others, {forged.count} do not verify: {forged}" if forged.count else ""
        return Check(
            SEAL_CHECK,
            Level.FAIL,
            f"{unreadable_count} decided rows cannot be read, a text in them not UTF-8 (written outside Kazma: "
            f"whoever did it can write the store; none of them will run): {shown}{more}{also}",
        ), sealed
    before = f"; {historic} decided before seals (they can never run)" if historic else ""
    if forged.count:
        return Check(
            SEAL_CHECK,
            Level.FAIL,
            f"{forged.count} decided rows whose seal does not verify, {forged.approved} of them approved (written "
            f"outside Kazma: whoever did it can write the store; none of them will run): {forged}",
        ), sealed
    if keyring is None and unknown.count:
        return Check(
            SEAL_CHECK, Level.FAIL, f"{unknown.count} sealed decisions cannot be verified: no usable decision key"
        ), sealed
    if unknown.count:
        return Check(
            SEAL_CHECK,
            Level.FAIL,
            f"{unknown.count} decisions sealed with keys not held here (approved ones will not run): {unknown}",
        ), sealed
    verified = rows - historic - sum(retired.values())
    old = "".join(
        f"; {count} sealed by retired key {key_id} (history, not checked; approved ones will not run)"
        for key_id, count in sorted(retired.items())
    )
    return Check(SEAL_CHECK, Level.OK, f"{verified} decisions verified{before}{old}"), sealed
