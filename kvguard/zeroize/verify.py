"""Verification: read planned blocks back and raise unless every byte is zero.

Modes (`VerifyMode`): `none` reads nothing; `sample` reads `sample_size` blocks drawn with a seeded
generator (every layer and half of each), enough to catch an executor that skipped a layer, a half or a
dtype's tail; `full` reads every planned block. A dirty block raises `ZeroizeVerificationError`: a
failed check is never reported as a result to inspect (STYLE.md, habit 4).
"""

from __future__ import annotations

import functools
import random
import secrets
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvguard.errors import ZeroizeError, ZeroizeVerificationError
from kvguard.zeroize import backend, triton_exec
from kvguard.zeroize.backend import MethodChoice
from kvguard.zeroize.evidence import VerifyMode
from kvguard.zeroize.layout import KVCacheSpec
from kvguard.zeroize.plan import ZeroizePlan

try:
    from kvguard.zeroize import _plan as _native  # the C draw; the same picks in Python without it
except ImportError:
    _native = None  # type: ignore[assignment]

DEFAULT_SAMPLE_SIZE = 8
_LISTED_IDS = 8  # dirty ids named in an error message; the count is always given


@dataclass(frozen=True)
class VerifyReport:
    """A passed verification (a failed one raises)."""

    mode: VerifyMode
    blocks_checked: int
    device_time_us: float | None
    wall_time_us: float


def parse_mode(mode: VerifyMode | str) -> VerifyMode:
    if mode.__class__ is VerifyMode:
        return mode
    # A dict first: `VerifyMode(str)` goes through the enum's metaclass, about 1 us per call.
    found = _MODES.get(mode) if isinstance(mode, str) else None
    if found is not None:
        return found
    try:
        return VerifyMode(mode)
    except ValueError:
        raise ZeroizeError(f"verify must be 'none', 'sample' or 'full', got {mode!r}") from None


_MODES: dict[str, VerifyMode] = {str(mode): mode for mode in VerifyMode}


def sample_blocks(plan: ZeroizePlan, sample_size: int, seed: int | None) -> list[int]:
    """`sample_size` of the plan's blocks, sorted; the same seed always picks the same blocks.

    `seed=None` draws from a process-wide generator seeded once from the OS (`secrets`), so an
    operator cannot predict which blocks are read: its state is never exposed (samples are not
    logged). Seeding per call cost 30-40 us of host time per zeroization on the H100 host
    (2026-11-26), more than the rest of the call.

    The draw (`draw_sample`, sample v2) takes `8 * sample_size` bytes from the generator and picks
    with Floyd's algorithm in C: `random.sample` of 8 ids took 3.5 us of the 30 us budget per call
    on that host (issue 14, item 2). A given seed therefore picks other blocks than it did before
    2026-11-27 (`random.Random(seed).sample`); either way, every k-subset is as likely as any other.
    """
    if sample_size < 1:
        raise ZeroizeError(f"sample_size must be at least 1, got {sample_size}")
    ids = plan.block_ids
    if sample_size >= len(ids):
        return list(ids)
    # Not a secret-deriving use: with a seed, the draw must be reproducible for an auditor.
    chooser = _unseeded_sampler() if seed is None else random.Random(seed)  # noqa: S311
    words = chooser.getrandbits(64 * sample_size).to_bytes(8 * sample_size, "little")
    return draw_sample(ids, sample_size, words)


def draw_sample(ids: Sequence[int], k: int, words: bytes) -> list[int]:
    """k of `ids` (1 <= k < len(ids)), in their order, as chosen by `words` (k little-endian 64-bit
    words, uniformly random).

    Floyd's algorithm (Bentley and Floyd, "A sample of brilliance", CACM 30(9), 1987): for j from
    n - k to n - 1, pick a position t uniform in [0, j], or j itself when t was picked already; every
    k-subset comes out with the same probability. t is floor(word * (j + 1) / 2**64) (Lemire's
    multiply-shift), uniform to within (j + 1) / 2**64 per step: no bias an auditor could measure.
    The C extension (`_plan.sample`) and `_sample_python` make the same draw (tests hold them equal).
    """
    if _native is not None and type(ids) is tuple:
        return _native.sample(ids, k, words)
    return _sample_python(ids, k, words)


def _sample_python(ids: Sequence[int], k: int, words: bytes) -> list[int]:
    n = len(ids)
    if not 1 <= k < n or len(words) != 8 * k:
        raise ValueError("k must be in [1, len(ids)) with 8 bytes of words per pick")
    picked: set[int] = set()
    for step, (word,) in enumerate(struct.iter_unpack("<Q", words)):
        j = n - k + step
        at = (word * (j + 1)) >> 64
        picked.add(j if at in picked else at)
    return [ids[at] for at in sorted(picked)]


@functools.cache
def _unseeded_sampler() -> random.Random:
    return random.Random(secrets.randbits(256))  # noqa: S311


def blocks_to_check(
    plan: ZeroizePlan, mode: VerifyMode, sample_size: int, seed: int | None
) -> list[int]:
    if mode is VerifyMode.NONE:
        return []
    if mode is VerifyMode.FULL:
        return list(plan.block_ids)
    return sample_blocks(plan, sample_size, seed)


def dirty_blocks_error(
    dirty: list[int], checked: int, mode: VerifyMode
) -> ZeroizeVerificationError:
    """The one error for a failed read-back: how many, of how many, and the first few ids."""
    return ZeroizeVerificationError(
        f"{len(dirty)} of {checked} checked blocks are not all-zero after zeroization "
        f"(mode {mode}, first ids {dirty[:_LISTED_IDS]}); the blocks must stay quarantined"
    )


def verify_zeroized(
    cache: KVCacheSpec,
    plan: ZeroizePlan,
    mode: VerifyMode | str = VerifyMode.FULL,
    *,
    sample_size: int = DEFAULT_SAMPLE_SIZE,
    seed: int | None = None,
    method: MethodChoice = "auto",
    stream: torch.cuda.Stream | None = None,
) -> VerifyReport:
    """Read the planned blocks back (per `mode`); raise ZeroizeVerificationError if any is not zero.

    Runs on `stream` (default: the current one), after everything already enqueued there.
    """
    backend.check_plan(cache, plan)
    chosen_mode = parse_mode(mode)
    executor = backend.resolve_method(cache, method)
    ids = blocks_to_check(plan, chosen_mode, sample_size, seed)
    started = time.perf_counter()
    with triton_exec.on_stream(cache, stream):
        timer = backend.DeviceTimer(cache)
        with timer:
            dirty = backend.find_dirty(cache, ids, executor) if ids else []
        device_us = timer.elapsed_us() if ids else None
    wall_us = (time.perf_counter() - started) * 1e6
    if dirty:
        raise dirty_blocks_error(dirty, len(ids), chosen_mode)
    return VerifyReport(chosen_mode, len(ids), device_us, wall_us)
