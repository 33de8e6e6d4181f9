"""An engine for the purge API tests without vLLM: a real `Custody`, its events converted and submitted
exactly as the vLLM adapter's ledger bridge does, purge commands acknowledged through the real
`CommandQueue`, heartbeats in the real engine registry, zeroization evidence in the worker's format,
and optionally an offload tier's ledger figures (the purge entry's `tier_*` details and the worker's
later `key.shred` entries, as docs/offload.md describes them)."""

from __future__ import annotations

import base64
import copy
import itertools
import json
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from kvguard.api.services import Services
from kvguard.audit import erasure
from kvguard.audit.certificate import CLAIMS, set_path
from kvguard.control.commands import PurgeCommand
from kvguard.engine_adapter.custody import Custody
from kvguard.engine_adapter.ledger_bridge import LedgerBridge
from kvguard.engine_adapter.records import CustodyEvent, EventKind, purge_event_kind
from kvguard.isolation.scope import (
    AdapterRef,
    CacheConfig,
    ModelRef,
    Scope,
    Share,
    TokenizerRef,
)
from kvguard.policy import AuditLevel, PolicySet
from kvguard.zeroize.evidence import Method, VerifyMode, ZeroizeEvidence

BLOCK_BYTES = 4096
MODEL = "tiny-llama"
_REQUESTS = itertools.count()


def scope(tenant: str, session: str | None = None, adapter: str | None = None) -> Scope:
    return Scope(
        tenant_id=tenant,
        share=Share.SESSION if session else Share.TENANT,
        session_id=session,
        model=ModelRef(id=MODEL, revision="1"),
        tokenizer=TokenizerRef(id="t", revision="1"),
        adapter=AdapterRef(id=adapter, revision="1") if adapter else None,
        cache_config=CacheConfig(kv_dtype="bf16", block_size=16),
    )


def evidence(blocks: int, mode: VerifyMode = VerifyMode.SAMPLE) -> dict[str, object]:
    """What the worker reports for one clear (`ZeroizeEvidence.as_audit_details`)."""
    return ZeroizeEvidence(
        block_count=blocks,
        block_ids_sha256="0" * 64,
        cache_blocks=64,
        layers=2,
        layout="vllm_cpu",
        dtype="bfloat16",
        bytes_cleared=blocks * BLOCK_BYTES,
        method=Method.TORCH,
        device="cpu",
        verify_mode=mode,
        blocks_verified=0 if mode is VerifyMode.NONE else min(blocks, 2),
        verified=None if mode is VerifyMode.NONE else True,
        device_time_us=None,
        verify_time_us=None,
        wall_time_us=12.5,
        timestamp=datetime.now(UTC),
    ).as_audit_details()


class SimEngine:
    """One engine process's kvguard side, driven by hand."""

    def __init__(
        self,
        services: Services,
        engine_id: str,
        *,
        num_blocks: int = 16,
        names: bool = True,
        tier: bool = False,
    ) -> None:
        self.services = services
        self.engine_id = engine_id
        self.names = names  # False: an engine that predates `engine_id` in its ledger details
        self.tier = tier  # an offload tier: purge entries carry its figures
        self.offloaded: dict[Scope, tuple[int, int]] = {}  # domain -> (ciphertexts, bytes)
        self.epochs: dict[Scope, int] = {}
        self.shreds: list[
            tuple[Scope, int, int, int]
        ] = []  # ordered: (domain, job, entries, bytes)
        self.custody = Custody(
            num_blocks, policy=PolicySet().policy_for, tagger=services.deriver.member_tag
        )
        self.bridge = LedgerBridge(services.ledger, lambda _tag: AuditLevel.MINIMAL)
        self.last_command = services.commands.latest_seq()
        services.engines.register(
            engine_id, model=MODEL, block_size=16, num_blocks=num_blocks, now=time.time()
        )

    def _details(self) -> dict[str, str]:
        return {"engine_id": self.engine_id} if self.names else {}

    def forward(self, events: Iterable[CustodyEvent]) -> None:
        self.bridge.forward(events)
        self.services.ledger.flush()

    def cache(self, s: Scope, blocks: list[int]) -> None:
        """A finished request whose blocks stay cached for reuse."""
        rid = f"r{next(_REQUESTS)}"
        self.custody.begin(rid, s, use_cache=True)
        self.custody.allocate(rid, blocks, time.time())
        self.custody.mark_hashed(blocks)
        self.custody.finish(rid, time.time())
        self.forward(self.custody.take_events())

    def hold(self, s: Scope, blocks: list[int]) -> str:
        """A running request holding `blocks` (a purge now only dooms them)."""
        rid = f"r{next(_REQUESTS)}"
        self.custody.begin(rid, s, use_cache=True)
        self.custody.allocate(rid, blocks, time.time())
        self.forward(self.custody.take_events())
        return rid

    def end(self, rid: str) -> None:
        self.custody.finish(rid, time.time())
        self.forward(self.custody.take_events())

    def run_commands(self) -> int:
        """Execute and acknowledge pending purge commands, as `engine_link.CommandRunner` does."""
        ran = 0
        for command in self.services.commands.pending_after(self.last_command):
            self.last_command = command.seq
            if not isinstance(command, PurgeCommand):
                continue
            details: dict[str, str | int] = {"command_id": command.id, **self._details()}
            if self.tier:
                details.update(self._tier_purge(command))
            quarantined = self.custody.purge(command.selector, time.time(), details=details)
            events = self.custody.take_events()
            doomed = sum(
                int(e.details.get("blocks_active_doomed") or 0)
                for e in events
                if e.kind is purge_event_kind(command.selector)
            )
            self.forward(events)
            result = {"blocks_quarantined": len(quarantined), "blocks_active_doomed": doomed}
            self.services.commands.acknowledge(command.id, self.engine_id, result)
            ran += 1
        return ran

    def zeroize(self, mode: VerifyMode = VerifyMode.SAMPLE) -> tuple[int, ...]:
        """The worker clears the step's release plan and the scheduler records it."""
        plan = self.custody.take_plan()
        if plan.release:
            details = {**evidence(len(plan.release), mode), **self._details()}
            self.custody.zeroized(plan.release, time.time(), details)
            self.forward(self.custody.take_events())
        return plan.release

    def handover_clear(self, blocks: list[int]) -> None:
        """A handover clear naming `blocks` (about their next owner, never a purge's evidence)."""
        details = {**evidence(len(blocks)), **self._details()}
        self.custody.zeroized(blocks, time.time(), details, handover=True)
        self.forward(self.custody.take_events())

    def spill(self, s: Scope, entries: int, nbytes: int) -> None:
        """The tier now holds `entries` ciphertexts (`nbytes`) of the domain `s` (it has a key)."""
        assert self.tier
        held = self.offloaded.get(s, (0, 0))
        self.offloaded[s] = (held[0] + entries, held[1] + nbytes)
        self.epochs.setdefault(s, 1)

    def _tier_purge(self, command: PurgeCommand) -> dict[str, int]:
        """The scheduler's part of a purge: shred every domain it selects (orders for the worker),
        and the purge entry's tier figures."""
        keys = entries = nbytes = 0
        for s in [s for s in self.offloaded if command.selector.matches(s)]:
            held, size = self.offloaded.pop(s)
            self.shreds.append((s, command.id, held, size))
            keys, entries, nbytes = keys + 1, entries + held, nbytes + size
        return {"tier_key_count": keys, "tier_entry_count": entries, "tier_bytes": nbytes}

    def shred(self, limit: int | None = None, **override: str | int | None) -> int:
        """The worker reports the ordered shreds (at most `limit`), a step after the purge: one
        `key.shred` entry each. `override` changes their details (None: leave the field out)."""
        done, self.shreds = self.shreds[:limit], self.shreds[len(self.shreds[:limit]) :]
        events = []
        for s, job, entries, nbytes in done:
            epoch = self.epochs[s]
            self.epochs[s] = epoch + 1
            details: dict[str, str | int | None] = {
                "engine_id": self.engine_id,
                "command_id": job,
                "reason": "purge",
                "destroyed_epoch": epoch,
                "entry_count": entries,
                "bytes_deleted": nbytes,
                **override,
            }
            details = {k: v for k, v in details.items() if v is not None}
            tag = self.services.deriver.scope_tag(s)
            events.append(CustodyEvent(EventKind.KEY_SHRED, time.time(), tag, None, (), details))
        self.forward(events)
        return len(done)

    def beat(self) -> None:
        self.services.engines.touch(self.engine_id, time.time())


def zeroize_entries(services: Services) -> int:
    page = services.ledger.query(kinds=[EventKind.ZEROIZE.value], limit=1000)
    return len(page.records)


def without_engine(cert: dict[str, Any], engine_id: str) -> dict[str, Any]:
    """`cert` with one engine left out whole (its entries, its listing), every ledger-backed total
    recomputed from the entries kept: a forger's best effort, so only the request entry's
    `engines_expected` can tell."""
    bad = copy.deepcopy(cert)
    kept = [
        e
        for e in bad["evidence"]["entries"]
        if json.loads(base64.b64decode(e["leaf"]))["details"].get("engine_id") != engine_id
    ]
    bad["evidence"]["entries"] = kept
    bad["media"]["engines"] = [e for e in bad["media"]["engines"] if e["engine_id"] != engine_id]
    objs = [(e["role"], e["index"], erasure.parse_leaf(base64.b64decode(e["leaf"]))) for e in kept]
    purges = [erasure.purge_entry(i, o) for r, i, o in objs if r == "purge"]
    zeroizes = [erasure.zeroize_entry(i, o) for r, i, o in objs if r == "zeroize"]
    shown = erasure.summary(purges, zeroizes, erasure.cover(purges, zeroizes))
    for path, key in CLAIMS.items():
        set_path(bad, path, shown[key])
    return bad
