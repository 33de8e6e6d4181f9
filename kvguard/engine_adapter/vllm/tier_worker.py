"""The worker half of the offload tier: block bytes in and out of the KV caches, encrypted.

The worker holds the tier itself (`EncryptedTier`, its data keys in this process's memory only) and
carries out the scheduler's orders each step, in this order (docs/offload.md):

1. `spill`, in `bind_connector_metadata` before the step's clears: the blocks the device evicted
   still hold their old owner's bytes (their new owner's forward pass has not run, and the handover
   clear comes next), so they are read out, encrypted under their domain's key and stored;
2. `drop`, then `shred`: entries the scheduler retired (budget, expiry) are deleted; shredded
   domains lose their data key and every ciphertext. After the spills, so a spill ordered before a
   purge is deleted by it;
3. `load`, in `start_load_kv`, after the clears: each entry is authenticated and decrypted, then
   copied into its freshly allocated block. A block whose entry fails authentication (or is gone) is
   reported to vLLM (`get_block_ids_with_load_errors`), which recomputes it (the connector runs with
   `kv_load_failure_policy: recompute`); it is never served.

On CPU all of this is synchronous. On a GPU the reads and writes run on the current stream (the
forward's), so they are ordered with the clears; a spill waits for its device-to-host copy, a cost
paid only by engines with a tier (benchmarks/offload_gpu.py measures it).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvguard.engine_adapter.vllm.metadata import ShredDone, ShredOrder, TierOrder, TierReport
from kvguard.errors import OffloadKeyError, TierAuthError, TierReadError
from kvguard.isolation.keyring import Keyring
from kvguard.logging import get_logger
from kvguard.offload import BlockAddress, EncryptedTier, OffloadKeys
from kvguard.offload.blocks import BlockCopier
from kvguard.zeroize import KVCacheSpec

_log = get_logger("vllm.tier")
_PROFILE_BLOCKS = 4


class WorkerTier:
    """The encrypted tier beside one worker's KV caches."""

    def __init__(
        self,
        keyring: Keyring,
        spec: KVCacheSpec,
        *,
        budget_bytes: int,
        directory: str | None = None,
    ) -> None:
        self.keys = OffloadKeys(keyring)
        # The scheduler keeps the budget (its index drops entries first); the slack only absorbs
        # orders still in flight.
        self.tier = EncryptedTier(
            self.keys, budget_bytes=2 * budget_bytes, directory=directory, clock=time.monotonic
        )
        self.copier = BlockCopier(spec)
        self._layers = (0, spec.num_layers)
        self._load_errors: set[int] = set()
        self._report = TierReport()
        self._report.restore_s_per_block = self._measure_restore()
        self._report.block_bytes = self.copier.block_bytes

    def address(self, order: TierOrder) -> BlockAddress:
        key = order.key
        return BlockAddress(key.domain, order.scope_tag, key.block_hash, self._layers, key.position)

    # --- orders -------------------------------------------------------------------------------

    def spill(self, orders: Sequence[TierOrder]) -> None:
        if not orders:
            return
        start = time.perf_counter()
        payloads = self.copier.read([o.block_id for o in orders])
        for order, payload in zip(orders, payloads, strict=True):
            try:
                self.tier.put(self.address(order), payload, to_disk=order.to_disk)
            except (OffloadKeyError, OSError) as exc:  # a spill that fails is a block not kept
                _log.error("offload spill failed; block not kept", error=type(exc).__name__)
                self._report.spill_failed.append(order)
                continue
            self._report.spilled.append((order, len(payload) + 16))
        self._report.spill_s += time.perf_counter() - start

    def drop(self, orders: Sequence[TierOrder]) -> None:
        for order in orders:
            self.tier.discard(self.address(order))

    def shred(self, orders: Sequence[ShredOrder]) -> None:
        for order in orders:
            report = self.tier.shred(order.domain)
            epoch = report.key.destroyed_epoch if report.key is not None else None
            self._report.shredded.append(
                ShredDone(order, epoch, report.removed.entries, report.removed.bytes)
            )

    def load(self, orders: Sequence[TierOrder]) -> None:
        if not orders:
            return
        start = time.perf_counter()
        good: list[TierOrder] = []
        payloads: list[bytes] = []
        for order in orders:
            try:
                payload = self.tier.get(self.address(order))
            except TierAuthError:
                self._fail(order, "auth")
                continue
            except TierReadError:  # its file is unreadable: recomputed, not the engine stopped
                self._fail(order, "io")
                continue
            except OffloadKeyError:  # its key was shredded meanwhile: as good as gone
                self._fail(order, "missing")
                continue
            if payload is None:
                self._fail(order, "missing")
            elif len(payload) != self.copier.block_bytes:
                self._fail(order, "size")
            else:
                good.append(order)
                payloads.append(payload)
        if good:
            self.copier.write([o.block_id for o in good], payloads)
        self._report.restored += good
        self._report.restore_s += time.perf_counter() - start

    def _fail(self, order: TierOrder, reason: str) -> None:
        self._load_errors.add(order.block_id)
        self._report.failed.append((order, reason))

    # --- results ------------------------------------------------------------------------------

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_report(self) -> TierReport | None:
        report, self._report = self._report, TierReport()
        return report if report else None

    def close(self) -> None:
        self.tier.close()

    def _measure_restore(self) -> float:
        """Seconds to authenticate, decrypt and copy in one block, measured on scratch memory (the
        KV caches are not touched): what a restore costs here, against recomputing its tokens."""
        size = self.copier.block_bytes
        aead = AESGCM(AESGCM.generate_key(bit_length=256))
        nonce = secrets.token_bytes(12)
        sealed = aead.encrypt(nonce, bytes(size), b"kvguard/offload-profile")
        scratch = torch.empty(size, dtype=torch.uint8, device=self.copier.spec.device)
        best = float("inf")
        for _ in range(_PROFILE_BLOCKS):
            start = time.perf_counter()
            plain = aead.decrypt(nonce, sealed, b"kvguard/offload-profile")
            scratch.copy_(torch.frombuffer(bytearray(plain), dtype=torch.uint8))
            if scratch.device.type == "cuda":
                torch.cuda.current_stream(scratch.device).synchronize()
            best = min(best, time.perf_counter() - start)
        return best
