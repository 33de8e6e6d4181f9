"""The scheduler's view of the offload tier: which blocks it holds, for whom, and what must leave.

The ciphertexts live next to the KV caches (the worker's `EncryptedTier`); the scheduler decides
what goes in, what is looked up and what leaves, so it keeps this index: one entry per stored block,
keyed by the block's reuse domain, its engine block hash (salted per scope) and its position. The
index is authoritative: the budget (engine-wide and per tenant), expiry and purges are decided here
and sent to the worker as drop and shred orders; an entry is added only when the worker reports the
ciphertext stored, so a lookup never promises a block the worker does not have.

Nothing here holds key material or KV bytes; the domain (`Scope.domain_key`) and block hashes stay
in memory and never reach a log or an event (events carry the scope tag and counts).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple


class TierKey(NamedTuple):
    """A block's place in the tier: its reuse domain, its engine block hash and its position."""

    domain: bytes
    block_hash: bytes
    position: int


@dataclass(slots=True)
class IndexEntry:
    key: TierKey
    tenant: str
    scope_tag: str
    size: int  # ciphertext bytes
    stored_at: float
    to_disk: bool = False
    # The block's life in the cache before it was spilled (its owner's retention counts from these:
    # a block's time in the tier is part of its cached life, not a new one). None: not known.
    created_at: float | None = None
    last_used_at: float | None = None


class TierIndex:
    """Entries in least-recently-used order within an engine-wide byte budget."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError("the offload tier's budget must be positive")
        self.budget = budget_bytes
        self._entries: OrderedDict[TierKey, IndexEntry] = OrderedDict()
        self._domain_count: Counter[bytes] = Counter()
        self._tenant_bytes: Counter[str] = Counter()
        self.used = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: TierKey) -> bool:
        return key in self._entries

    def tenant_bytes(self, tenant: str) -> int:
        return self._tenant_bytes.get(tenant, 0)

    def domains(self) -> list[bytes]:
        return list(self._domain_count)

    def tenants(self) -> list[str]:
        """The tenants holding entries."""
        return list(self._tenant_bytes)

    def disk_tenants(self, domain: bytes) -> set[str]:
        """The tenants whose entries of the domain are stored on disk."""
        if not self.has_domain(domain):
            return set()
        return {e.tenant for k, e in self._entries.items() if k.domain == domain and e.to_disk}

    def trim(self, tenant: str, cap: int | None) -> list[IndexEntry]:
        """Remove the tenant's least recently used entries until it holds at most `cap` bytes
        (a cap lowered by a new policy version); returns them. None: no cap."""
        if cap is None or self._tenant_bytes.get(tenant, 0) <= cap:
            return []
        out: list[IndexEntry] = []
        for key in [k for k, e in self._entries.items() if e.tenant == tenant]:
            if self._tenant_bytes.get(tenant, 0) <= cap:
                break
            out.append(self._pop(key))
        return out

    def domain_usage(self, domain: bytes) -> tuple[int, int]:
        """(entries, ciphertext bytes) the domain holds."""
        held = [e.size for k, e in self._entries.items() if k.domain == domain]
        return len(held), sum(held)

    def add(self, entry: IndexEntry, *, tenant_cap: int | None) -> list[IndexEntry]:
        """Record a stored block; returns the entries that must leave to keep the tenant within
        `tenant_cap` and the tier within its budget, oldest first. An entry larger than either limit
        is itself returned (the worker must drop it). An entry at the same key was replaced by the
        worker's store already: it is forgotten here, not returned."""
        out: list[IndexEntry] = []
        self.remove(entry.key)
        cap = self.budget if tenant_cap is None else min(tenant_cap, self.budget)
        if entry.size > cap:
            return [entry]
        self._insert(entry)
        if self._tenant_bytes[entry.tenant] > cap:
            for key in [k for k, e in self._entries.items() if e.tenant == entry.tenant]:
                if self._tenant_bytes[entry.tenant] <= cap:
                    break
                if key != entry.key:
                    out.append(self._pop(key))
        while self.used > self.budget:
            oldest = next(iter(self._entries))
            out.append(self._pop(oldest))
        return out

    def run(self, domain: bytes, hashes: Sequence[bytes], start: int, stop: int) -> list[TierKey]:
        """The keys of the consecutive stored blocks of `hashes[start:stop]` in `domain`, from
        `start` on (a prefix must be contiguous to be used)."""
        out: list[TierKey] = []
        for position in range(start, min(stop, len(hashes))):
            key = TierKey(domain, bytes(hashes[position]), position)
            if key not in self._entries:
                break
            out.append(key)
        return out

    def touch(self, keys: Sequence[TierKey]) -> None:
        for key in keys:
            if key in self._entries:
                self._entries.move_to_end(key)

    def get(self, key: TierKey) -> IndexEntry | None:
        return self._entries.get(key)

    def remove(self, key: TierKey) -> IndexEntry | None:
        return self._pop(key) if key in self._entries else None

    def remove_domain(self, domain: bytes) -> list[IndexEntry]:
        if not self._domain_count.get(domain):
            return []
        return [self._pop(k) for k in [k for k in self._entries if k.domain == domain]]

    def expire(self, now: float, expired: Callable[[IndexEntry, float], bool]) -> list[IndexEntry]:
        """Remove the entries `expired(entry, now)` says have had their time."""
        doomed = [k for k, e in self._entries.items() if expired(e, now)]
        return [self._pop(k) for k in doomed]

    def has_domain(self, domain: bytes) -> bool:
        return bool(self._domain_count.get(domain))

    def _insert(self, entry: IndexEntry) -> None:
        self._entries[entry.key] = entry
        self._domain_count[entry.key.domain] += 1
        self._tenant_bytes[entry.tenant] += entry.size
        self.used += entry.size

    def _pop(self, key: TierKey) -> IndexEntry:
        entry = self._entries.pop(key)
        self._domain_count[key.domain] -= 1
        if not self._domain_count[key.domain]:
            del self._domain_count[key.domain]
        self._tenant_bytes[entry.tenant] -= entry.size
        if not self._tenant_bytes[entry.tenant]:
            del self._tenant_bytes[entry.tenant]
        self.used -= entry.size
        return entry
