"""Which ledger entries a filtered export holds: one predicate for `kvguard audit export`, the API's
streamed export and the offline verifier, so that what an exporter selects and what a verifier
holds a bundle to cannot drift apart.

The filters are `kvguard.audit.query.select_indices`'s: a scope tag (`scope_tag`) or any of several
(`scope_tags`: an empty list matches nothing, never everybody), kinds (none or an empty list: every
kind), `since` inclusive and `until` not. Times compare in whole microseconds since the epoch, the
precision of a leaf's `ts` and of the ledger's `ts_us` column. No database or model imports: the
offline verifier runs on an auditor's machine with this module alone."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def ts_micros(ts: datetime) -> int:
    """Microseconds since the Unix epoch (exact integer arithmetic, no float rounding)."""
    delta = ts - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _utc_micros(ts: datetime | None) -> int | None:
    """`ts_micros`, a time that names no zone read as UTC; None for None."""
    if ts is None:
        return None
    return ts_micros(ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC))


@dataclass(frozen=True, slots=True)
class Selection:
    """A filtered export's filters. `tags` None: every scope tag; `kinds` None: every kind;
    `low` / `high`: microsecond bounds, `low` inclusive, `high` not."""

    tags: frozenset[str] | None = None
    kinds: frozenset[str] | None = None
    low: int | None = None
    high: int | None = None

    @classmethod
    def of(
        cls,
        *,
        scope_tag: str | None = None,
        scope_tags: Iterable[str] | None = None,
        kinds: Iterable[str] | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> Selection:
        """The selection of these filters; `scope_tag` and `scope_tags` together select entries
        that both name."""
        tags = None if scope_tag is None else frozenset((scope_tag,))
        if scope_tags is not None:
            listed = frozenset(scope_tags)
            tags = listed if tags is None else tags & listed
        wanted = frozenset(kinds) if kinds else None  # an empty list: every kind, as in the query
        return cls(tags, wanted, _utc_micros(since), _utc_micros(until))

    def holds(self, scope_tag: object, kind: object, ts_us: int) -> bool:
        """Whether an entry with this scope tag, kind and time (microseconds) is selected."""
        return (
            (self.tags is None or scope_tag in self.tags)
            and (self.kinds is None or kind in self.kinds)
            and (self.low is None or ts_us >= self.low)
            and (self.high is None or ts_us < self.high)
        )
