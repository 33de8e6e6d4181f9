"""A versioned, append-only policy store on SQLAlchemy (SQLite by default, PostgreSQL tested).

Every `put` adds a version row; nothing is updated in place or deleted, so `history()` is the full record
of who changed policy, when and why. Version numbers are gapless: the next one is taken from a single
head row under a row lock (PostgreSQL: `SELECT ... FOR UPDATE`; SQLite: `BEGIN IMMEDIATE`), never from a
sequence, which may skip numbers (ARCHITECTURE.md, "Gapless indices").

Each row holds the canonical JSON of the policy and its digest; reads recompute the digest and refuse a
row that does not match. Subscribers (the audit ledger records `policy.change` entries) are called inside
the writing transaction, after the row is written and before commit: if one raises, the version is
rolled back, because a policy change the ledger could not record must not take effect (G5, G7).
The tables and the database-level append-only guards are in `kvguard.policy.schema`.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Engine, create_engine, event, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, defer

from kvguard.errors import PolicyStoreError, PolicyVersionConflictError
from kvguard.logging import get_logger
from kvguard.policy.loading import parse_policy
from kvguard.policy.models import PolicySet
from kvguard.policy.schema import (
    AUTHOR_MAX,
    HEAD_ID,
    REASON_MAX,
    PolicyBase,
    PolicyHead,
    PolicyVersionRow,
)

Clock = Callable[[], float]

_LOCK_OPTION: Final = "kvguard_policy_write_lock"

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


class PolicyStore:
    """Versioned policy documents in tables prefixed `policy_` (own MetaData)."""

    def __init__(self, engine: Engine, *, clock: Clock = time.time) -> None:
        self._engine = engine
        self._clock = clock
        self._subscribers: list[Subscriber] = []
        self._subscribers_lock = threading.Lock()

    @classmethod
    def open(cls, url: str, *, clock: Clock = time.time, **engine_kwargs: Any) -> PolicyStore:
        """Connect to `url`, create the tables if missing, and return the store."""
        engine = create_engine(url, **engine_kwargs)
        if engine.dialect.name == "sqlite":
            _enable_sqlite_write_lock(engine)
        store = cls(engine, clock=clock)
        store.create_schema()
        return store

    @property
    def engine(self) -> Engine:
        return self._engine

    def create_schema(self) -> None:
        """Create the tables and the head row (idempotent, safe to race)."""
        try:
            PolicyBase.metadata.create_all(self._engine)
            with Session(self._engine) as session, session.begin():
                if session.get(PolicyHead, HEAD_ID) is None:
                    session.add(PolicyHead(id=HEAD_ID, version=0))
        except IntegrityError:
            pass  # another process created the head row first: that is the outcome we wanted
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
    ) -> int:
        """Store `policy_set` as the next version and return its number.

        With `expected_version` (0: the store is empty) the write happens only if the latest version is
        still that one, checked under the write lock; otherwise PolicyVersionConflictError, and nothing
        is stored (a compare-and-set: no concurrent writer's version is silently overwritten)."""
        _check_text("author", author, AUTHOR_MAX)
        _check_text("reason", reason, REASON_MAX)
        document = policy_set.canonical_json()
        # Re-validate what will be stored: a PolicySet built with model_construct() skips validation,
        # and a version that cannot be read back would fail every engine closed later, far from here.
        parse_policy(document, "policy to store", fmt="json")
        with self._subscribers_lock:
            subscribers = list(self._subscribers)
        try:
            with self._engine.connect() as conn:
                conn.execution_options(**{_LOCK_OPTION: True})
                with Session(bind=conn) as session, session.begin():
                    change = self._append(session, document, author, reason, expected_version)
                    _notify(subscribers, change)
        except SQLAlchemyError as exc:
            raise PolicyStoreError(f"cannot store the policy: {type(exc).__name__}") from exc
        _log.info("policy.stored", version=change.version, digest=change.digest)
        return change.version

    def _append(
        self,
        session: Session,
        document: str,
        author: str,
        reason: str,
        expected_version: int | None = None,
    ) -> PolicyChange:
        head = session.scalars(
            select(PolicyHead).where(PolicyHead.id == HEAD_ID).with_for_update()
        ).one_or_none()
        if head is None:
            raise PolicyStoreError("policy store has no head row: call create_schema() first")
        if expected_version is not None and head.version != expected_version:
            raise PolicyVersionConflictError(
                f"the policy store is at version {head.version}, not {expected_version}"
            )
        head.version += 1
        change = PolicyChange(
            version=head.version,
            author=author,
            reason=reason,
            digest=_digest(document),
            at=self._clock(),
        )
        session.add(
            PolicyVersionRow(
                version=change.version,
                created_at=change.at,
                author=author,
                reason=reason,
                digest=change.digest,
                document=document,
            )
        )
        session.flush()
        return change

    def current(self) -> PolicyVersion | None:
        """The latest version, or None when nothing has been stored yet."""
        with self._read() as session:
            row = session.scalars(
                select(PolicyVersionRow).order_by(PolicyVersionRow.version.desc()).limit(1)
            ).first()
            return None if row is None else _to_version(row)

    def get(self, version: int) -> PolicyVersion:
        """A given version; PolicyStoreError when it does not exist."""
        with self._read() as session:
            row = session.get(PolicyVersionRow, version)
            if row is None:
                raise PolicyStoreError(f"policy version {version} does not exist")
            return _to_version(row)

    def history(self) -> list[PolicyChange]:
        """Every version's metadata, oldest first."""
        with self._read() as session:
            rows = session.scalars(
                select(PolicyVersionRow)
                .options(defer(PolicyVersionRow.document))  # metadata only: documents can be large
                .order_by(PolicyVersionRow.version)
            ).all()
            return [_to_change(row) for row in rows]

    def _read(self) -> Session:
        return Session(self._engine)


def _notify(subscribers: list[Subscriber], change: PolicyChange) -> None:
    # Raising here leaves the `session.begin()` block with an exception, which rolls the version back.
    for callback in subscribers:
        try:
            callback(change)
        except Exception as exc:
            raise PolicyStoreError(
                f"policy version {change.version} not stored: a change subscriber failed"
            ) from exc


def _check_text(name: str, value: str, limit: int) -> None:
    # Every change must say who and why: an anonymous or unexplained change is useless as evidence.
    if not value.strip():
        raise PolicyStoreError(f"{name} must not be empty")
    if len(value) > limit:
        raise PolicyStoreError(f"{name} is longer than {limit} characters")


def _digest(document: str) -> str:
    return "sha256:" + hashlib.sha256(document.encode("utf-8")).hexdigest()


def _to_change(row: PolicyVersionRow) -> PolicyChange:
    return PolicyChange(
        version=row.version,
        author=row.author,
        reason=row.reason,
        digest=row.digest,
        at=row.created_at,
    )


def _to_version(row: PolicyVersionRow) -> PolicyVersion:
    if _digest(row.document) != row.digest:
        raise PolicyStoreError(f"policy version {row.version} does not match its digest")
    policy = parse_policy(row.document, f"policy store version {row.version}", fmt="json")
    return PolicyVersion(change=_to_change(row), policy=policy)


def _enable_sqlite_write_lock(engine: Engine) -> None:
    """Let `put` open its transaction with BEGIN IMMEDIATE (SQLAlchemy's documented pysqlite recipe).

    pysqlite's own transaction handling delays BEGIN until the first write, so two writers could both
    read the head row and one would fail at upgrade. Taking the write lock at BEGIN serializes them.
    """

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy, not the driver, emits BEGIN
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=10000")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        immediate = conn.get_execution_options().get(_LOCK_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")
