"""A versioned, append-only policy store on SQLAlchemy (SQLite by default, PostgreSQL tested).

Every `put` adds a version row; nothing is updated in place or deleted, so `history()` is the full record
of who changed policy, when and why. Version numbers are gapless: the next one is taken from a single
head row under a row lock (PostgreSQL: `SELECT ... FOR UPDATE`; SQLite: `BEGIN IMMEDIATE`), never from a
sequence, which may skip numbers (ARCHITECTURE.md, "Gapless indices").

Each row holds the canonical JSON of the policy and its digest; reads recompute the digest and refuse a
row that does not match. Subscribers (the audit ledger records `policy.change` entries) are called inside
the writing transaction, after the row is written and before commit: if one raises, the version is
rolled back, because a policy change the ledger could not record must not take effect (G5, G7).
The tables and the database-level append-only guards are in `kvguard.control.schema` (created by the
control migrations, `kvguard.control.db`).
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from kvguard.control.db import (
    create_engine,
    ensure_schema,
    reading,
    write_transaction,
)
from kvguard.control.schema import (
    ALL_TENANTS,
    AUTHOR_MAX,
    HEAD_ID,
    NO_LIMITS,
    REASON_MAX,
    PolicyHead,
    PolicyVersionRow,
)
from kvguard.errors import PolicyStoreError, PolicyVersionConflictError
from kvguard.logging import get_logger
from kvguard.policy.edits import CanonicalParts, checked_edit, reread
from kvguard.policy.loading import parse_policy
from kvguard.policy.models import PolicySet, TenantPolicy

Clock = Callable[[], float]
_PARSED_MAX = 64
_LIMITS_MAX = 4096  # tenants' limit entries kept (references to parts of parsed versions)
_LATEST, _GAP, _ANCHOR = 0, 1, 2  # the parts of `_latest_and_limits_query`'s rows
# Statements run on every read of the current policy, built once (building one costs about as
# much as running it).
_CHANGE_COLUMNS = (  # a version's metadata: what `_to_change` reads
    PolicyVersionRow.version,
    PolicyVersionRow.author,
    PolicyVersionRow.reason,
    PolicyVersionRow.digest,
    PolicyVersionRow.created_at,
)
_LATEST_CHANGE = sa.select(*_CHANGE_COLUMNS).order_by(PolicyVersionRow.version.desc()).limit(1)
_VERSION_ROW = sa.select(*PolicyVersionRow.__table__.c).where(
    PolicyVersionRow.version == sa.bindparam("version")
)

_log = get_logger("policy.store")


@dataclass(frozen=True, slots=True)
class PolicyChange:
    """One stored version's metadata: what the ledger records as a `policy.change` entry."""

    version: int
    author: str
    reason: str
    digest: str
    at: float


@dataclass(frozen=True, slots=True)
class PolicyVersion:
    """A stored version: its metadata and the policy itself."""

    change: PolicyChange
    policy: PolicySet


Subscriber = Callable[[PolicyChange], None]
Anchor = tuple[str, float]  # a version's digest and time: which row a number stood for


@dataclass(slots=True)
class _LimitIndex:
    """Which admin versions set one tenant's limits alone, as far as this process knows: for the
    versions in (`floor`, `upto`], each tenant's latest such version (number, digest); a tenant
    absent has none there. Filled from the base reads (`PolicyStore.latest_and_limits`) and this
    process's own commits, so that a tenant_admin's write finds its limits without a query
    (`PolicyStore.tenant_limit`). Empty (`upto` < 0) until the first base read. `anchor` is the
    digest and time of version `upto` as learnt: a base read finds it changed when the database
    was restored to an earlier state and written again since, and then starts again."""

    floor: int = 0
    upto: int = -1
    latest: dict[str, tuple[int, str]] = field(default_factory=dict)
    anchor: Anchor | None = None

    def find(self, tenant_id: str, after: int, upto: int) -> tuple[bool, tuple[int, str] | None]:
        """Whether the index knows `tenant_id`'s latest admin version in (`after`, `upto`], and
        that version (None: there is none)."""
        if self.upto < 0 or after < self.floor or upto > self.upto:
            return False, None
        entry = self.latest.get(tenant_id)
        if entry is None:
            return True, None
        if entry[0] > upto:  # a later one is known, not the latest up to `upto`
            return False, None
        return True, (entry if entry[0] > after else None)

    def add(
        self, start: int, end: int, entries: Iterable[tuple[str, int, str]], anchor: Anchor
    ) -> None:
        """Learn the versions in (`start`, `end`]: `entries` holds each tenant's latest admin
        version among them (tenant, number, digest), and no other tenant has one there;
        `anchor` is version `end`'s digest and time."""
        if end < start:  # the store holds fewer versions than this process knew (a restore)
            self.floor, self.upto, self.latest, self.anchor = end, end, {}, anchor
            return
        if self.upto < 0 or start > self.upto or len(self.latest) >= _LIMITS_MAX:
            self.floor, self.upto, self.latest = start, end, {}  # not contiguous: start again
        elif end < self.floor:
            return
        for tenant_id, version, digest in entries:
            held = self.latest.get(tenant_id)
            if held is None or held[0] < version:
                self.latest[tenant_id] = (version, digest)
        if end >= self.upto:
            self.upto, self.anchor = end, anchor


class PolicyStore:
    """Versioned policy documents in tables prefixed `policy_` (own MetaData)."""

    def __init__(self, engine: Engine, *, clock: Clock = time.time) -> None:
        self._engine = engine
        self._clock = clock
        self._subscribers: list[Subscriber] = []
        self._subscribers_lock = threading.Lock()
        # Versions are immutable: each is parsed and digest-checked once per process (a read of the
        # current version then costs one small indexed query, not a parse of the whole set). A
        # process that parsed a version keeps enforcing it even if its row is later edited behind
        # the triggers' back; any process that reads the edited row refuses it.
        self._parsed: dict[int, PolicyVersion] = {}
        # Parsed documents by digest (content-addressed: one digest, one document, one PolicySet).
        # A writer puts what it validated here, so the version it stores is not parsed again when
        # it is first read (its row is still read and checked against its digest then).
        self._documents: dict[str, PolicySet] = {}
        self._parts = CanonicalParts()  # the canonical JSON of parsed parts, for edits of them
        # Each tenant's entry in the admin versions that set its limits alone, by (tenant id,
        # version, digest): what a tenant_admin's write is checked against (`tenant_limit`).
        self._limits: dict[tuple[str, int, str], TenantPolicy] = {}
        self._limit_index = _LimitIndex()  # which versions those are, per tenant

    @classmethod
    def open(cls, url: str, *, clock: Clock = time.time, **engine_kwargs: Any) -> PolicyStore:
        """Connect to `url`, create the tables if missing, and return the store."""
        if engine_kwargs:
            raise TypeError(f"unexpected arguments: {sorted(engine_kwargs)}")
        store = cls(create_engine(url), clock=clock)
        store.create_schema()
        return store

    @property
    def engine(self) -> Engine:
        return self._engine

    def create_schema(self) -> None:
        """Create the tables and the head row (idempotent, safe to race)."""
        try:
            ensure_schema(self._engine)  # the migrations create the head row too
        except SQLAlchemyError as exc:
            raise PolicyStoreError(
                f"cannot create the policy tables: {type(exc).__name__}"
            ) from exc

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call `callback` with every new version before it commits; returns an unsubscribe function."""
        with self._subscribers_lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._subscribers_lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def put(
        self,
        policy_set: PolicySet,
        *,
        author: str,
        reason: str,
        expected_version: int | None = None,
        author_role: str = "admin",
        limits_of: str = ALL_TENANTS,
        conn: sa.Connection | None = None,
    ) -> int:
        """Store `policy_set` as the next version and return its number.

        With `expected_version` (0: the store is empty) the write happens only if the latest version is
        still that one, checked under the write lock; otherwise PolicyVersionConflictError, and nothing
        is stored (a compare-and-set: no concurrent writer's version is silently overwritten). With
        `conn`, the version is written inside the caller's write transaction (and commits with it)."""
        return self.put_with(
            lambda _current: policy_set,
            author=author,
            reason=reason,
            expected_version=expected_version,
            author_role=author_role,
            limits_of=limits_of,
            conn=conn,
        ).version

    def put_with(
        self,
        edit: Callable[[PolicyVersion | None], PolicySet],
        *,
        author: str,
        reason: str,
        expected_version: int | None = None,
        author_role: str = "admin",
        limits_of: str = ALL_TENANTS,
        conn: sa.Connection | None = None,
    ) -> PolicyChange:
        """Store `edit(<the latest version>)` as the next version: a read-modify-write that no
        concurrent writer can interleave with.

        The edit (parsing, editing and validating the whole set: milliseconds of CPU) runs before
        the head row is locked, on the latest version then; under the lock the head is checked to
        still be that version, and only if another writer got in between is the edit redone under
        the lock. The lock is thus held for the inserts, not for the validation, and writers do not
        queue behind each other's CPU work. `limits_of`: whose limits an admin's version sets (every
        tenant's, or one tenant id's: `PolicyVersionRow`); a tenant_admin's sets none."""
        check_metadata(author, reason)
        if conn is None:
            try:
                with write_transaction(self._engine) as own:
                    change = self.put_with(
                        edit,
                        author=author,
                        reason=reason,
                        expected_version=expected_version,
                        author_role=author_role,
                        limits_of=limits_of,
                        conn=own,
                    )
            except SQLAlchemyError as exc:
                raise PolicyStoreError(f"cannot store the policy: {type(exc).__name__}") from exc
            _log.info("policy.stored", version=change.version, digest=change.digest)
            return change
        seen = self.current(conn=conn)
        document = self._edited(edit, seen)
        head = self.lock_head(conn)
        if expected_version is not None and head != expected_version:
            raise PolicyVersionConflictError(
                f"the policy store is at version {head}, not {expected_version}"
            )
        if head != (seen.change.version if seen else 0):  # another writer got in: edit again
            document = self._edited(edit, self.current(conn=conn))
        change = PolicyChange(
            version=head + 1,
            author=author,
            reason=reason,
            digest=_digest(document),
            at=self._clock(),
        )
        conn.execute(
            sa.insert(PolicyVersionRow).values(
                version=change.version,
                created_at=change.at,
                author=author,
                reason=reason,
                digest=change.digest,
                document=document,
                author_role=author_role,
                limits_of=limits_for_role(author_role, limits_of),
            )
        )
        conn.execute(
            sa.update(PolicyHead).where(PolicyHead.id == HEAD_ID).values(version=change.version)
        )
        with self._subscribers_lock:
            subscribers = list(self._subscribers)
        _notify(subscribers, change)
        return change

    def lock_head(self, conn: sa.Connection) -> int:
        """Lock the head row until the transaction ends; returns the latest version number."""
        version = conn.execute(
            sa.select(PolicyHead.version).where(PolicyHead.id == HEAD_ID).with_for_update()
        ).scalar_one_or_none()
        if version is None:
            raise PolicyStoreError("policy store has no head row: run the control migrations")
        return int(version)

    def latest_and_limits(
        self, conn: sa.Connection | None = None
    ) -> tuple[PolicyVersion | None, PolicyVersion | None]:
        """The latest version and the latest that set every tenant's limits (what a tenant_admin
        may tighten but never loosen; None: the built-in defaults), both as of one statement, so
        the limits are those of the latest version. The same statement lists, for the versions
        this process has not seen since that limits version, each tenant's latest admin version
        that set its limits alone (metadata only), so that `tenant_limit` needs no query of its
        own for them."""
        with self._subscribers_lock:
            index = self._limit_index
            known, anchor = max(index.upto, 0), index.anchor
        query = _latest_and_limits_query()
        with self._reading(conn) as c:
            found = c.execute(query, {"known": known}).all()
            rows = sorted((r for r in found if r.part == _LATEST), key=lambda r: -int(r.version))
            versions = [self._cached(c, row) for row in rows]
        if not versions:
            return None, None
        admin = next((int(r.version) for r in rows if r.by_admin), 0)
        gap = [(r.limits_of, int(r.version), r.digest) for r in found if r.part == _GAP]
        stood = next(((r.digest, r.created_at) for r in found if r.part == _ANCHOR), None)
        with self._subscribers_lock:
            if known and stood != anchor:  # version `known` is not the row this process learnt
                self._limit_index = _LimitIndex()
                known = 0
            latest = rows[0]
            self._limit_index.add(
                max(known, admin), int(latest.version), gap, (latest.digest, latest.created_at)
            )
        if rows[0].limits_of not in (None, ALL_TENANTS, NO_LIMITS):  # an admin's edit of one tenant
            self.remember_limit(rows[0].limits_of, versions[0])
        limits = next((v for v, row in zip(versions, rows, strict=True) if row.by_admin), None)
        return versions[0], limits

    def _cached(self, conn: sa.Connection, row: Any) -> PolicyVersion:
        cached = self._parsed.get(int(row.version))
        if cached is not None and cached.change == _to_change(row):
            return cached
        return self._version(conn, int(row.version), row.digest)

    def validated_document(
        self, policy_set: PolicySet, *, base: PolicyVersion | None = None
    ) -> tuple[str, str]:
        """The canonical JSON of `policy_set` and its digest, validated as a reader will parse it
        (see `_edited`); what a writer stores as a version. With `base` (the version edited), only
        the parts that are not `base`'s own objects are validated again, if this store parsed or
        validated `base` itself (`kvguard.policy.edits`)."""
        document = self._edited(lambda _current: policy_set, base)
        return document, _digest(document)

    def remember_committed(self, change: PolicyChange) -> PolicyVersion | None:
        """Cache a version this process has just committed (its document validated by
        `validated_document`), so that its first read does not parse it again; None if that
        document is no longer cached."""
        with self._subscribers_lock:
            policy = self._documents.get(change.digest)
        if policy is None:
            return None
        version = PolicyVersion(change=change, policy=policy)
        self._remember(version)
        return version

    def drafted(self, change: PolicyChange, document: str) -> PolicyVersion:
        """A version a writer validated (`validated_document`) but has not committed: the base
        the next write of the same group commit edits (`kvguard.control.publish`). Not kept as a
        stored version; parsed again only if its document is no longer cached."""
        with self._subscribers_lock:
            policy = self._documents.get(change.digest)
        if policy is None:
            policy = parse_policy(document, f"policy draft version {change.version}", fmt="json")
            with self._subscribers_lock:
                self._remember_document(change.digest, policy)
        return PolicyVersion(change=change, policy=policy)

    def tenant_limit(
        self, tenant_id: str, after: int, upto: int, conn: sa.Connection | None = None
    ) -> TenantPolicy | None:
        """`tenant_id`'s entry in the latest version in (`after`, `upto`] by which an admin set
        `tenant_id`'s limits alone (an edit of its entry, a disable); None if there is none.
        Without a query when the base reads and this process's commits have covered that range
        (`_LimitIndex`), else one index lookup; the entry is kept per version
        (`remember_limit`), so a version is read only the first time."""
        with self._subscribers_lock:
            indexed, entry = self._limit_index.find(tenant_id, after, upto)
            known = self._limits.get((tenant_id, *entry)) if entry is not None else None
        if indexed and entry is None:
            return None
        if known is not None:
            return known
        t = PolicyVersionRow
        with self._reading(conn) as c:
            if entry is not None:
                version = self._version(c, *entry)
                if version.change.digest == entry[1]:
                    return self.remember_limit(tenant_id, version)
            row = c.execute(
                sa.select(*_CHANGE_COLUMNS)
                .where(t.limits_of == tenant_id, t.version > after, t.version <= upto)
                .order_by(t.version.desc())
                .limit(1)
            ).first()
            if row is None:
                return None
            with self._subscribers_lock:
                known = self._limits.get((tenant_id, int(row.version), row.digest))
            if known is not None:
                return known
            version = self._cached(c, row)
        return self.remember_limit(tenant_id, version)

    def committed_limits(self, base: int, versions: Sequence[tuple[PolicyChange, str]]) -> None:
        """This process has just committed `versions` (each change with its `limits_of`), the
        ones right after `base`: what `tenant_limit` finds without a query (added to what it knew
        if that reached `base`, else in its place)."""
        if not versions:
            return
        entries = [
            (limits_of, change.version, change.digest)
            for change, limits_of in versions
            if limits_of not in (ALL_TENANTS, NO_LIMITS)
        ]
        last = versions[-1][0]
        with self._subscribers_lock:
            self._limit_index.add(base, base + len(versions), entries, (last.digest, last.at))

    def forget_limits(self) -> None:
        """Find which versions set a tenant's limits in the database again (a restore; tests)."""
        with self._subscribers_lock:
            self._limit_index = _LimitIndex()

    def remember_limit(self, tenant_id: str, version: PolicyVersion) -> TenantPolicy:
        """Keep `version`'s entry for `tenant_id`, an admin's version that set that tenant's
        limits (`tenant_limit`), and return it. Versions never change: keyed by number and
        digest, an entry is never stale."""
        limit = version.policy.policy_for(tenant_id)
        key = (tenant_id, version.change.version, version.change.digest)
        with self._subscribers_lock:
            if len(self._limits) >= _LIMITS_MAX:
                self._limits.pop(next(iter(self._limits)), None)
            self._limits[key] = limit
        return limit

    def current(self, conn: sa.Connection | None = None) -> PolicyVersion | None:
        """The latest version, or None when nothing has been stored yet (one query of its
        metadata once this process has read the version)."""
        with self._reading(conn) as c:
            latest = c.execute(_LATEST_CHANGE).first()
            if latest is None:
                return None
            cached = self._parsed.get(int(latest.version))
            if cached is not None and cached.change == _to_change(latest):
                return cached
            return self._version(c, int(latest.version), latest.digest)

    def get(self, version: int) -> PolicyVersion:
        """A given version; PolicyStoreError when it does not exist."""
        t = PolicyVersionRow
        with self._reading(None) as c:
            digest = c.execute(sa.select(t.digest).where(t.version == version)).scalar()
            if digest is None:
                raise PolicyStoreError(f"policy version {version} does not exist")
            return self._version(c, version, digest)

    def _version(self, conn: sa.Connection, version: int, digest: str) -> PolicyVersion:
        """A version, parsed and digest-checked once per process (versions never change). The
        cache is keyed by number and checked against the stored digest: a number read inside a
        transaction that then rolled back, and reused by another writer, is parsed afresh."""
        cached = self._parsed.get(version)
        if cached is not None and cached.change.digest == digest:
            return cached
        row = conn.execute(_VERSION_ROW, {"version": version}).first()
        if row is None:
            raise PolicyStoreError(f"policy version {version} does not exist")
        parsed = self._to_version(row)
        self._remember(parsed)
        return parsed

    def _to_version(self, row: Any) -> PolicyVersion:
        """A stored row, its document checked against its digest (every first read of a version in
        a process checks the row); parsed unless this process parsed that document already."""
        if _digest(row.document) != row.digest:
            raise PolicyStoreError(f"policy version {row.version} does not match its digest")
        with self._subscribers_lock:
            policy = self._documents.get(row.digest)
        if policy is None:
            policy = self._parse(row.document, int(row.version))
        return PolicyVersion(change=_to_change(row), policy=policy)

    def _parse(self, document: str, version: int) -> PolicySet:
        """A stored version's document as a reader parses it: read as an edit of the version
        nearest to it that this process holds (`kvguard.policy.edits.reread`: only the tenant
        entries that differ are parsed, and the result is checked to be that very text), else
        parsed whole. Versions written by another API process are read this way before they are
        edited, and consecutive versions differ in one tenant's entry."""
        with self._subscribers_lock:
            nearest = min(
                self._parsed.values(), key=lambda v: abs(v.change.version - version), default=None
            )
        if nearest is not None:
            policy = reread(document, nearest.policy, self._parts)
            if policy is not None:
                return policy
        return parse_policy(document, f"policy store version {version}", fmt="json", stored=True)

    def _remember(self, version: PolicyVersion) -> None:
        with self._subscribers_lock:
            if len(self._parsed) >= _PARSED_MAX:
                self._parsed.pop(next(iter(self._parsed)), None)
            self._parsed[version.change.version] = version
            self._remember_document(version.change.digest, version.policy)

    def _remember_document(self, digest: str, policy: PolicySet) -> None:
        # Called with `_subscribers_lock` held.
        if len(self._documents) >= _PARSED_MAX:
            self._documents.pop(next(iter(self._documents)), None)
        self._documents[digest] = policy

    def _edited(
        self, edit: Callable[[PolicyVersion | None], PolicySet], current: PolicyVersion | None
    ) -> str:
        """The canonical JSON of `edit(current)`, validated as a reader will parse it."""
        edited = edit(current)
        # Re-validate what will be stored: a PolicySet built with model_construct() skips
        # validation, and a version that cannot be read back would fail every engine closed
        # later, far from here. The result is what any reader parses from the stored document.
        # An edit of a version this store validated re-validates only the parts it replaced,
        # plus the set's own rules (`kvguard.policy.edits` says why that is the same check);
        # anything else, or anything that fails there, is parsed whole (and its problems
        # reported at their field paths).
        base = current.policy if current is not None and self._validated(current) else None
        parsed = checked_edit(edited, base, self._parts) if base is not None else None
        if parsed is not None:
            document = self._parts.document(parsed)
        else:
            document = edited.canonical_json()
            parsed = parse_policy(document, "policy to store", fmt="json")
        with self._subscribers_lock:
            self._remember_document(_digest(document), parsed)
        return document

    def _validated(self, version: PolicyVersion) -> bool:
        """Whether `version.policy` is the very set this store parsed or validated for it."""
        with self._subscribers_lock:
            return self._documents.get(version.change.digest) is version.policy

    def history(self, *, after: int = 0, limit: int | None = None) -> list[PolicyChange]:
        """The metadata of the versions after `after`, oldest first; at most `limit` of them (a
        page: one index range on the primary key, whatever the store holds)."""
        t = PolicyVersionRow
        query = sa.select(*_CHANGE_COLUMNS).where(t.version > after).order_by(t.version)
        if limit is not None:
            query = query.limit(limit)
        with self._reading(None) as c:
            rows = c.execute(query).all()  # metadata only: documents can be large
            return [_to_change(row) for row in rows]

    def _reading(self, conn: sa.Connection | None) -> AbstractContextManager[sa.Connection]:
        """`conn`, or a read connection of this store's own (`kvguard.control.db.reading`)."""
        return reading(self._engine, conn)


def _notify(subscribers: list[Subscriber], change: PolicyChange) -> None:
    # Raising here leaves the `session.begin()` block with an exception, which rolls the version back.
    for callback in subscribers:
        try:
            callback(change)
        except Exception as exc:
            raise PolicyStoreError(
                f"policy version {change.version} not stored: a change subscriber failed"
            ) from exc


def check_metadata(author: str, reason: str) -> None:
    """Refuse a change without an author or a reason, or with one over its column's size."""
    _check_text("author", author, AUTHOR_MAX)
    _check_text("reason", reason, REASON_MAX)


def _check_text(name: str, value: str, limit: int) -> None:
    # Every change must say who and why: an anonymous or unexplained change is useless as evidence.
    if not value.strip():
        raise PolicyStoreError(f"{name} must not be empty")
    if len(value) > limit:
        raise PolicyStoreError(f"{name} is longer than {limit} characters")


def _digest(document: str) -> str:
    return "sha256:" + hashlib.sha256(document.encode("utf-8")).hexdigest()


def _to_change(row: Any) -> PolicyChange:
    return PolicyChange(
        version=row.version,
        author=row.author,
        reason=row.reason,
        digest=row.digest,
        at=row.created_at,
    )


def limits_for_role(author_role: str, limits_of: str) -> str:
    """What a version's `limits_of` records: a tenant_admin's version sets no limits."""
    return NO_LIMITS if author_role == "tenant_admin" else limits_of


def _all_tenants_limits() -> Any:
    """The latest version that set every tenant's limits, as a scalar subquery: the latest marked
    `*`, or one stored before `limits_of` existed by an admin (two index lookups on
    `ix_policy_versions_limits_of`, not a scan of the versions)."""
    t = PolicyVersionRow
    marked = sa.select(sa.func.max(t.version).label("v")).where(t.limits_of == ALL_TENANTS)
    legacy = sa.select(sa.func.max(t.version).label("v")).where(
        t.limits_of.is_(None), sa.or_(t.author_role.is_(None), t.author_role != "tenant_admin")
    )
    both = sa.union_all(marked, legacy).subquery()
    return sa.select(sa.func.max(both.c.v)).scalar_subquery()


@functools.cache
def _latest_and_limits_query() -> sa.CompoundSelect[Any]:
    """`PolicyStore.latest_and_limits`'s statement, built once (building it costs more than
    running it), its rows told apart by `part`: the latest version and the latest that set every
    tenant's limits (`_LATEST`); each tenant's latest admin version that set its limits alone
    among the versions after both `known` and that limits version (`_GAP`); version `known`
    itself (`_ANCHOR`), to tell whether it is still the row this process learnt."""
    t = PolicyVersionRow
    latest = sa.select(sa.func.max(t.version)).scalar_subquery()
    by_admin = _all_tenants_limits()
    known = sa.bindparam("known", type_=sa.BigInteger)
    admin_version = sa.func.coalesce(by_admin, 0)
    start = sa.case((admin_version > known, admin_version), else_=known)
    newest = (
        sa.select(t.limits_of, sa.func.max(t.version).label("version"))
        .where(
            t.version > start,
            t.version <= latest,
            t.limits_of.is_not(None),
            t.limits_of.not_in([ALL_TENANTS, NO_LIMITS]),
        )
        .group_by(t.limits_of)
        .subquery()
    )
    v = PolicyVersionRow.__table__.alias("v")
    columns = ("version", "author", "reason", "digest", "created_at", "limits_of")
    return sa.union_all(
        sa.select(
            *(getattr(t, name) for name in columns),
            (t.version == by_admin).label("by_admin"),
            sa.literal(_LATEST).label("part"),
        ).where(t.version.in_([latest, by_admin])),
        sa.select(
            *(v.c[name] for name in columns),
            sa.literal(False).label("by_admin"),
            sa.literal(_GAP).label("part"),
        ).join_from(v, newest, v.c.version == newest.c.version),
        sa.select(
            *(getattr(t, name) for name in columns),
            sa.literal(False).label("by_admin"),
            sa.literal(_ANCHOR).label("part"),
        ).where(t.version == known),
    )
