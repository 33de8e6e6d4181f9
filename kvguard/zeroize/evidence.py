"""Evidence of one zeroization: what was cleared, how, how it was checked, how long it took.

An evidence record names blocks only by count and digest and never holds KV bytes, so it can go into
logs and the audit ledger as it is (G6). `as_audit_details()` is the `details` mapping of the ledger's
`block.zeroize` event; the event itself (scope tag, request id, block id list) is built by the caller,
which knows the scope.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime

DetailValue = str | int | float | bool | None

EVIDENCE_VERSION = 1


class VerifyMode(enum.StrEnum):
    """How much of a plan is read back after clearing."""

    NONE = "none"  # trust the executor; nothing read back
    SAMPLE = "sample"  # a seeded random sample of the plan's blocks, every layer of each
    FULL = "full"  # every planned block, every layer


class Method(enum.StrEnum):
    """Which executor cleared the blocks."""

    TRITON = "triton"  # one Triton launch over all layers and blocks
    TORCH = "torch"  # tensor ops per segment


@dataclass(frozen=True)
class ZeroizeEvidence:
    """What one zeroization did. Built only after verification passed (a failure raises), and only
    once the device has finished (`PendingZeroize.evidence()`), so the device times are measured."""

    block_count: int
    block_ids_sha256: str  # `ZeroizePlan.block_ids_digest()`
    cache_blocks: int  # blocks in the cache the plan was made for
    layers: int
    layout: str
    dtype: str
    bytes_cleared: int
    method: Method
    device: str  # device name, e.g. "NVIDIA H100 80GB HBM3", or "cpu"
    verify_mode: VerifyMode
    blocks_verified: int  # blocks read back: 0 for `none`, k for `sample`, all for `full`
    verified: bool | None  # True: every block read back was all-zero; None: none was read back
    # CUDA-event times of the clearing and read-back launches; None when not measured: off the GPU,
    # or a call made with `timed=False` (no guess is ever recorded in their place)
    device_time_us: float | None
    verify_time_us: float | None
    wall_time_us: float  # host time of the enqueue (zeroize_async) or whole call (zeroize)
    timestamp: datetime  # from the injected clock, when the call started

    def as_audit_details(self) -> dict[str, DetailValue]:
        """Flat, JSON-ready facts for the ledger's `block.zeroize` event (no ids, no bytes)."""
        return {
            "evidence_v": EVIDENCE_VERSION,
            "block_count": self.block_count,
            "block_ids_sha256": self.block_ids_sha256,
            "cache_blocks": self.cache_blocks,
            "layers": self.layers,
            "layout": self.layout,
            "dtype": self.dtype,
            "bytes_cleared": self.bytes_cleared,
            "method": str(self.method),
            "device": self.device,
            "verify_mode": str(self.verify_mode),
            "blocks_verified": self.blocks_verified,
            "verified": self.verified,
            "device_time_us": _rounded(self.device_time_us),
            "verify_time_us": _rounded(self.verify_time_us),
            "wall_time_us": _rounded(self.wall_time_us),
            "started_at": self.timestamp.isoformat(),
        }


def _rounded(value: float | None) -> float | None:
    # A tenth of a microsecond is below event resolution; rounding keeps ledger leaves short.
    return None if value is None else round(value, 1)
