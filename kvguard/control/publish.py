"""Admin writes that step a shared head row: a policy version, a purge command. Each commits with
its engine command and its ledger events (outbox rows) in one transaction, and on PostgreSQL that
transaction is one statement.

Why one statement. `policy_head` and `command_head` are single rows that every policy write (and,
for `command_head`, every purge) locks until it commits: whatever a writer does between taking the
lock and committing is time every other writer waits. The first version of the API held
`policy_head` across about ten round trips (lock, inserts, outbox rows, command head, command,
NOTIFY, commit), and under load each reply waited for the GIL behind the request threads: policy
writes were serialised at about 20 per second (docs/benchmarks.md, "Control plane under load").
Here everything that can be computed without the lock is computed first (the edited policy set,
its validation, its canonical JSON and digest, the events), and the write is one data-modifying
`WITH` statement run in autocommit: the rows are locked and released inside the server, without a
round trip to the client while they are held.

Policy versions (`PolicyPublisher.publish`), a compare-and-set on the head:

1. The base: the latest version and the latest one that set every tenant's limits (what a
   tenant_admin may only tighten), as this process last wrote them, else read in one query; an
   admin's later versions that set one tenant's limits (`TenantLimits`) are looked up per tenant
   when a tenant_admin's write needs them: the same query lists which versions those are
   (`PolicyStore.latest_and_limits`), so the lookup reads nothing unless the version itself is
   not parsed in this process yet.
2. `edit(base)` gives the new policy set (the caller's checks, against the base, raise here);
   it is validated and its events are built for version `base + 1`.
3. PostgreSQL: one statement steps `policy_head` from `base` to `base + 1` only if it still is at
   `base` (`UPDATE ... WHERE version = :base`; READ COMMITTED re-checks the condition after a
   concurrent writer commits), inserts the version, the outbox rows, steps `command_head`, inserts
   the engine command, ends the registry disables of tenants the version re-enables (`reenabled`)
   and notifies engines; all of it or, if the head has moved, none of it. A
   write that finds the head moved starts again from a fresh base, at most `OPTIMISTIC_TRIES`
   times; then it locks the head first (`SELECT ... FOR UPDATE` in a transaction), so it cannot
   be overtaken again. The admin API runs its policy writes on one thread per process
   (`kvguard.api.services`), so only writers of other processes ever move the head under it.

   The version a write stores is therefore always an edit of the version it replaces, and a
   tenant_admin's entry is checked against the limits as of that version: the same guarantees as
   editing under the head's row lock, with the lock held for microseconds. A refusal needs the
   same care, since no compare-and-set confirms the base it was made against: a group whose
   every write was refused over this process's own last version is drafted again over the
   latest one, so that a limit another process has since raised does not refuse it.
4. SQLite: the same rows, as separate statements in one `BEGIN IMMEDIATE` transaction (its
   database lock serialises writers anyway, and there are no network round trips to save).

Group commit (`PolicyPublisher.publish_group`; the admin API's policy writer sends every write
queued behind the one being stored): the writes are drafted in order, each an edit of the draft
before it (its checks, expected version and tenant_admin limits against that draft, as if the
writes came one at a time; a write that is refused is left out and the next edits the draft
before it), and stored together: one statement as above for a single version; for several, that
statement once per version (the head's guard lets it step by one only), pipelined by psycopg in
one transaction that is rolled back unless every one of them stepped the head. A head that another
process moved redoes the whole group from a fresh base, as a single write is redone.

`events(change)` stands in for `PolicyStore.subscribe`: the publisher calls no store subscribers
(the admin API registers none); what a write must record goes into its own outbox rows.

Purges (`submit_purge`): the job id is drawn from the command id sequence first (no lock), so that
the `admin.action` event can name it; then one statement steps `command_head`, inserts the command
and the events and notifies engines.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import sqlalchemy as sa

from kvguard.audit.events import AuditEvent
from kvguard.control.commands import NOTIFY_CHANNEL, CommandQueue, PurgeKind, PurgeSelector
from kvguard.control.db import read_connection, write_transaction
from kvguard.control.outbox import Outbox, event_json
from kvguard.control.publish_sql import PG_NEXT_COMMAND_ID, PG_POLICY_WRITE, PG_PURGE_WRITE
from kvguard.control.schema import (
    ALL_TENANTS,
    HEAD_ID,
    NO_LIMITS,
    PolicyHead,
    PolicyVersionRow,
)
from kvguard.control.tenants import END_DISABLES
from kvguard.errors import (
    ConfigError,
    PolicyStoreError,
    PolicyVersionConflictError,
    PreconditionRequiredError,
)
from kvguard.logging import get_logger
from kvguard.policy.models import PolicySet, TenantPolicy
from kvguard.policy.store import (
    PolicyChange,
    PolicyStore,
    PolicyVersion,
    check_metadata,
    limits_for_role,
)

# Fresh bases tried before locking the head: only writers in other processes can move it.
OPTIMISTIC_TRIES: Final = 3
CONTENDED_S: Final = 5.0  # after a failed compare-and-set, bases are read first for this long
_log = get_logger("control.publish")


TenantLimitsLookup = Callable[[str, int, int], TenantPolicy | None]  # tenant, after, upto


class TenantLimits:
    """The admin versions later than a base's `limits` that set one tenant's limits alone (an
    admin's edit of that tenant's entry, a disable): read per tenant, when a tenant_admin's write
    needs them, from the versions in (`after`, `upto`], and remembered; the drafts of a group add
    their own. So an admin's write of one tenant's entry never turns another tenant's own
    tightening into that tenant's limits."""

    __slots__ = ("_after", "_known", "_lookup", "_upto")

    def __init__(
        self,
        lookup: TenantLimitsLookup,
        after: int,
        upto: int,
        known: dict[str, TenantPolicy | None] | None = None,
    ) -> None:
        self._lookup, self._after, self._upto = lookup, after, upto
        self._known: dict[str, TenantPolicy | None] = dict(known or {})

    def get(self, tenant_id: str) -> TenantPolicy | None:
        """`tenant_id`'s entry in the latest admin version that set its limits alone, if any."""
        if tenant_id not in self._known:  # one writer thread per process uses a base at a time
            found = (
                self._lookup(tenant_id, self._after, self._upto)
                if self._upto > self._after
                else None
            )
            self._known[tenant_id] = found
        return self._known[tenant_id]

    def with_tenant(self, tenant_id: str, limit: TenantPolicy) -> TenantLimits:
        return TenantLimits(
            self._lookup, self._after, self._upto, {**self._known, tenant_id: limit}
        )


@dataclass(frozen=True, slots=True)
class PolicyBase:
    """What a policy write edits: the latest version and the limits as of it: `limits` the latest
    version that set every tenant's (None: none, the built-in defaults), `tenant_limits` the later
    ones that set one tenant's."""

    current: PolicyVersion | None
    limits: PolicyVersion | None
    tenant_limits: TenantLimits

    @property
    def version(self) -> int:
        return self.current.change.version if self.current else 0

    def limit_for(self, tenant_id: str) -> TenantPolicy:
        """What a tenant_admin of `tenant_id` may tighten but never loosen, as of this base."""
        own = self.tenant_limits.get(tenant_id)
        if own is not None:
            return own
        return (self.limits.policy if self.limits else PolicySet()).policy_for(tenant_id)


PolicyEdit = Callable[[PolicyBase], PolicySet]
PolicyEvents = Callable[[PolicyChange], Sequence[AuditEvent]]


@dataclass(frozen=True, slots=True)
class PolicyWrite:
    """One policy write: `edit(<base>)` stored with `events(change)`; with `expected_version`, only
    over that version (PolicyVersionConflictError otherwise)."""

    edit: PolicyEdit
    author: str
    reason: str
    author_role: str
    events: PolicyEvents
    expected_version: int | None = None
    # Whose limits an admin's write sets: every tenant's, or the one tenant id it edits.
    limits_of: str = ALL_TENANTS


PolicyOutcome = PolicyChange | Exception  # a write's stored version, or why it was refused


@dataclass(frozen=True, slots=True)
class _Draft:
    change: PolicyChange
    document: str
    author_role: str
    limits_of: str
    events: Sequence[AuditEvent]
    reenabled: list[str]  # tenants the version enables that its base disabled (`reenabled`)


def reenabled(base: PolicyVersion | None, new: PolicySet) -> list[str]:
    """The tenants with an entry in `base` or `new` that `base` disables (by the entry or the
    default) and `new` enables. Storing `new` ends their registry disables in the same transaction
    (`tenants.END_DISABLES`): a crash between two transactions would leave the registry saying
    disabled, its next disable refused as "already disabled", while engines serve the tenant. (A
    registry disable always has an entry: `POST /v1/tenants/{id}/disable` writes one and the admin
    API's whole-set PUT keeps it, `routes.policies.keep_disabled`.)"""
    if base is None:
        return []
    old = base.policy
    named = old.tenants.keys() | new.tenants.keys()
    return sorted(t for t in named if not old.policy_for(t).enabled and new.policy_for(t).enabled)


def _require_precondition(base: PolicyVersion | None, new: PolicySet, again: list[str]) -> None:
    """A version that re-enables what `base` disables (tenants, `again`, or every tenant through the
    default) must name the version it edits: a document read before a disable (`GET` prints every
    entry's `enabled: true`) and written back after it would otherwise undo the disable without a
    word (found by a review). With `If-Match` / `expected_version` the write is either over the
    version that disables (a deliberate re-enable) or refused 412."""
    default_back = base is not None and not base.policy.default.enabled and new.default.enabled
    if not again and not default_back:
        return
    named = ", ".join(again[:5]) + (f" and {len(again) - 5} more" if len(again) > 5 else "")
    what = f"re-enables disabled tenants ({named})" if again else "re-enables the default"
    raise PreconditionRequiredError(
        f"this policy version {what}: send If-Match (or expected_version) with the current "
        "version, so that a document read before a disable cannot undo it"
    )


@dataclass(frozen=True, slots=True)
class _Batch:
    """Drafts of a group of writes, each over the one before it: `outcomes` in write order."""

    outcomes: list[PolicyOutcome]
    drafts: list[_Draft]
    last: PolicyBase  # the base after the last draft


def _is_postgres(engine: sa.Engine) -> bool:
    return engine.dialect.name == "postgresql"


class PolicyPublisher:
    """Stores policy versions with their command and events (module docstring)."""

    def __init__(
        self,
        store: PolicyStore,
        outbox: Outbox,
        commands: CommandQueue,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._outbox = outbox
        self._commands = commands
        self._engine = store.engine
        self._clock = clock
        self._lock = threading.Lock()  # guards `_base`
        # The base as of this process's last committed write: the next write's compare-and-set
        # checks it, so it needs no read while this process is the only writer.
        self._base: PolicyBase | None = None
        # Until then, another process has been writing too: read the base before each write
        # rather than find out from a failed compare-and-set (an edit and a round trip wasted).
        self._contended_until = 0.0

    def _contended(self) -> bool:
        with self._lock:
            return time.monotonic() < self._contended_until

    def publish(
        self,
        edit: PolicyEdit,
        *,
        author: str,
        reason: str,
        author_role: str,
        events: PolicyEvents,
        expected_version: int | None = None,
    ) -> PolicyChange:
        """Store `edit(<base>)` as the next version with its engine command and `events(change)`
        in one transaction. PolicyVersionConflictError (nothing stored) when `expected_version`
        is given and the latest version is another one."""
        write = PolicyWrite(edit, author, reason, author_role, events, expected_version)
        outcome = self.publish_group([write])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def publish_group(self, writes: Sequence[PolicyWrite]) -> list[PolicyOutcome]:
        """Store `writes` as consecutive versions, each an edit of the one before it, in one
        transaction (a group commit): the outcome of each, in order. A write whose edit or checks
        raise is left out (its outcome is the exception) and the next one edits the version
        before it, as if the refused write had come alone; the others commit together or, on a
        database error, none of them (raised)."""
        if not writes:
            return []
        if _is_postgres(self._engine):
            for attempt in range(OPTIMISTIC_TRIES):
                fresh = (
                    attempt > 0
                    or any(w.expected_version is not None for w in writes)
                    or self._contended()
                )
                base = self._base_for(None, fresh=fresh)
                batch = self._drafts(writes, base)
                if not batch.drafts:
                    if fresh:  # every write refused against the latest version
                        return self._committed(batch)
                    # Refused against this process's last write, which another process may have
                    # followed (no compare-and-set confirms that base): ask the latest.
                    continue
                if self._pg_write(base.version, batch.drafts):
                    return self._committed(batch)
                _log.debug("policy head moved; editing the new version", attempt=attempt)
                with self._lock:
                    self._contended_until = time.monotonic() + CONTENDED_S
        with write_transaction(self._engine) as conn:
            self._store.lock_head(conn)  # SQLite: `BEGIN IMMEDIATE` already holds the database
            base = self._base_for(conn, fresh=True)
            batch = self._drafts(writes, base)
            if batch.drafts and not self._locked_write(conn, base.version, batch.drafts):
                raise PolicyStoreError("the policy head moved while it was locked")
        return self._committed(batch)

    def _base_for(self, conn: sa.Connection | None, *, fresh: bool) -> PolicyBase:
        with self._lock:
            known = self._base
        if known is not None and not fresh:
            return known
        current, limits = self._store.latest_and_limits(conn)  # None: a read of its own
        upto = current.change.version if current else 0
        after = limits.change.version if limits else 0
        return PolicyBase(current, limits, TenantLimits(self._tenant_limits, after, upto))

    def _tenant_limits(self, tenant_id: str, after: int, upto: int) -> TenantPolicy | None:
        # A read of its own: the versions up to `upto` are committed and never change, and a
        # write over a base that has moved since fails its compare-and-set and starts again.
        return self._store.tenant_limit(tenant_id, after, upto)

    def _drafts(self, writes: Sequence[PolicyWrite], base: PolicyBase) -> _Batch:
        outcomes: list[PolicyOutcome] = []
        drafts: list[_Draft] = []
        for write in writes:
            try:
                draft = self._draft(write, base)
            except Exception as exc:  # this write's refusal (412, 403, 422...): its caller's
                outcomes.append(exc)
                continue
            drafts.append(draft)
            outcomes.append(draft.change)
            current = self._store.drafted(draft.change, draft.document)
            if draft.limits_of == ALL_TENANTS:
                done = current.change.version
                base = PolicyBase(current, current, TenantLimits(self._tenant_limits, done, done))
            elif draft.limits_of != NO_LIMITS:  # an admin's edit of one tenant
                limit = current.policy.policy_for(draft.limits_of)
                tenants = base.tenant_limits.with_tenant(draft.limits_of, limit)
                base = PolicyBase(current, base.limits, tenants)
            else:  # a tenant_admin's: the limits stay
                base = PolicyBase(current, base.limits, base.tenant_limits)
        return _Batch(outcomes, drafts, base)

    def _draft(self, write: PolicyWrite, base: PolicyBase) -> _Draft:
        check_metadata(write.author, write.reason)
        if write.expected_version is not None and base.version != write.expected_version:
            raise PolicyVersionConflictError(
                f"the policy store is at version {base.version}, not {write.expected_version}"
            )
        edited = write.edit(base)
        again = reenabled(base.current, edited)
        if write.expected_version is None:
            _require_precondition(base.current, edited, again)
        document, digest = self._store.validated_document(edited, base=base.current)
        change = PolicyChange(
            version=base.version + 1,
            author=write.author,
            reason=write.reason,
            digest=digest,
            at=self._clock(),
        )
        limits_of = limits_for_role(write.author_role, write.limits_of)
        events = list(write.events(change))
        return _Draft(change, document, write.author_role, limits_of, events, again)

    def _committed(self, batch: _Batch) -> list[PolicyOutcome]:
        if batch.drafts:
            self._store.committed_limits(
                batch.drafts[0].change.version - 1, [(d.change, d.limits_of) for d in batch.drafts]
            )
        for draft in batch.drafts:
            version = self._store.remember_committed(draft.change)
            if version is not None and draft.limits_of not in (ALL_TENANTS, NO_LIMITS):
                self._store.remember_limit(draft.limits_of, version)
            _log.info("policy.stored", version=draft.change.version, digest=draft.change.digest)
        last = batch.last
        with self._lock:
            if batch.drafts and (self._base is None or self._base.version < last.version):
                self._base = last
        return batch.outcomes

    def forget(self) -> None:
        """Read the base from the database at the next write (tests; a restore)."""
        with self._lock:
            self._base = None
        self._store.forget_limits()

    def _pg_write(self, base: int, drafts: Sequence[_Draft]) -> bool:
        """PostgreSQL: the versions of `drafts` (`base + 1` onwards), each with its command and
        events, if the head is still at `base`; False (and nothing written) if it is not.

        One version: one autocommit statement (module docstring). Several: that statement once
        per version, each stepping the head from the version before it (the head's guard allows
        steps of one only), sent together in one transaction; psycopg pipelines an executemany,
        so the row locks are held across one round trip and the commit, not one per version. A
        statement whose head has moved writes nothing, and then the group is rolled back (its
        later statements could otherwise step a head another process moved)."""
        params = [self._pg_params(base + n, draft) for n, draft in enumerate(drafts)]
        if len(drafts) == 1:
            with read_connection(self._engine) as conn:  # autocommit: one statement, one commit
                return conn.execute(PG_POLICY_WRITE, params[0]).first() is not None
        try:
            with write_transaction(self._engine) as conn:
                if conn.execute(PG_POLICY_WRITE, params).rowcount != len(drafts):
                    raise _HeadMovedError
        except _HeadMovedError:
            return False
        return True

    @staticmethod
    def _pg_params(base: int, draft: _Draft) -> dict[str, object]:
        change = draft.change
        return {
            **_version_row(draft),
            "head_id": HEAD_ID,
            "base": base,
            "now": time.time(),
            "selector_value": str(change.version),
            "requested_by": change.author,
            "events": [event_json(e) for e in draft.events],
            "reenabled": draft.reenabled,
            "channel": NOTIFY_CHANNEL,
        }

    def _locked_write(self, conn: sa.Connection, base: int, drafts: Sequence[_Draft]) -> bool:
        """In the caller's transaction, which holds the head (SQLite's `BEGIN IMMEDIATE`; on
        PostgreSQL a `FOR UPDATE` after `OPTIMISTIC_TRIES`): the same rows as `_pg_write` (one
        pipelined round trip on PostgreSQL, statement by statement on SQLite)."""
        if _is_postgres(self._engine):
            params = [self._pg_params(base + n, draft) for n, draft in enumerate(drafts)]
            return bool(conn.execute(PG_POLICY_WRITE, params).rowcount == len(drafts))
        for n, draft in enumerate(drafts):
            change = draft.change
            stepped = conn.execute(
                sa.update(PolicyHead)
                .where(PolicyHead.id == HEAD_ID, PolicyHead.version == base + n)
                .values(version=change.version)
            ).rowcount
            if stepped != 1:
                return False
            conn.execute(sa.insert(PolicyVersionRow).values(**_version_row(draft)))
            self._outbox.add(conn, draft.events)
            self._commands.submit_policy(change.version, requested_by=change.author, conn=conn)
            if draft.reenabled:
                conn.execute(END_DISABLES, {"ids": draft.reenabled})
        return True


class _HeadMovedError(Exception):
    """A group's first statement found the policy head moved: roll the group back."""


def _version_row(draft: _Draft) -> dict[str, object]:
    change = draft.change
    return {
        "version": change.version,
        "created_at": change.at,
        "author": change.author,
        "reason": change.reason,
        "digest": change.digest,
        "document": draft.document,
        "author_role": draft.author_role,
        "limits_of": draft.limits_of,
    }


def submit_purge(
    commands: CommandQueue,
    outbox: Outbox,
    selector: PurgeSelector,
    *,
    requested_by: str,
    events: Callable[[int], Sequence[AuditEvent]],
    created_at: float | None = None,
) -> int:
    """Queue a purge for every engine with `events(job_id)` in one transaction; returns the job
    id (one statement on PostgreSQL, module docstring). `created_at`: when the caller counted the
    engines the job waits for (`CommandQueue.submit_purge`)."""
    if not selector.value:
        raise ConfigError("a purge needs a non-empty session, tenant, model or adapter id")
    if selector.kind is PurgeKind.SESSION and not selector.tenant_id:
        raise ConfigError("a session purge needs the tenant the session belongs to")
    engine = commands.engine
    if not _is_postgres(engine):
        with write_transaction(engine) as conn:
            job_id = commands.submit_purge(
                selector, requested_by=requested_by, conn=conn, created_at=created_at
            )
            outbox.add(conn, events(job_id))
        return job_id
    with read_connection(engine) as conn:  # autocommit
        job_id = int(conn.execute(PG_NEXT_COMMAND_ID).scalar_one())
        written = conn.execute(
            PG_PURGE_WRITE,
            {
                "head_id": HEAD_ID,
                "id": job_id,
                "now": time.time() if created_at is None else created_at,
                "selector_kind": selector.kind.value,
                "selector_value": selector.value,
                "tenant_id": selector.tenant_id,
                "requested_by": requested_by,
                "events": [event_json(e) for e in events(job_id)],
                "channel": NOTIFY_CHANNEL,
            },
        ).scalar_one()
    if written != job_id:
        raise PolicyStoreError("the purge command was not stored")
    return job_id
