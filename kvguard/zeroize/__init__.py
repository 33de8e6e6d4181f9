"""Physical cleanup of KV blocks.

Owns: cache layout descriptions, planning which bytes to clear, executors (one-launch Triton kernel on
GPU, torch on CPU), verification read-back and evidence records. Never decides *whether* a block is
zeroized: the custody core asks policy and hands this package a plan. Importing it needs neither Triton
nor a GPU.

Ownership chain: the engine owns the cache tensors and their bytes; `KVCacheSpec` only describes them;
the custody core owns the block ids and builds a `ZeroizePlan` with `plan_zeroize`; `zeroize_async`
enqueues the clear and the check on the engine's stream and returns a `PendingZeroize`, whose verdict
and `ZeroizeEvidence` (for the ledger) are read once the device has finished; `zeroize` does the same
and waits. An engine worker keeps its in-flight clears in a `StepZeroizer`. See docs/zeroize.md.
"""

from kvguard.zeroize.evidence import Method, VerifyMode, ZeroizeEvidence
from kvguard.zeroize.executor import zeroize, zeroize_async
from kvguard.zeroize.layout import SUPPORTED_DTYPES, KVCacheSpec, KVLayout
from kvguard.zeroize.pending import PendingZeroize
from kvguard.zeroize.plan import (
    BlockRun,
    ZeroizePlan,
    digest_block_ids,
    native_planner_available,
    plan_zeroize,
)
from kvguard.zeroize.triton_exec import triton_available
from kvguard.zeroize.verify import DEFAULT_SAMPLE_SIZE, VerifyReport, verify_zeroized

__all__ = [
    "DEFAULT_SAMPLE_SIZE",
    "SUPPORTED_DTYPES",
    "BlockRun",
    "KVCacheSpec",
    "KVLayout",
    "Method",
    "PendingZeroize",
    "VerifyMode",
    "VerifyReport",
    "ZeroizeEvidence",
    "ZeroizePlan",
    "digest_block_ids",
    "native_planner_available",
    "plan_zeroize",
    "triton_available",
    "verify_zeroized",
    "zeroize",
    "zeroize_async",
]
