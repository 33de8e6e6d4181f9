"""Stub of the optional C extension built from _plan.c; see that file and plan.py."""

def unique_sorted(
    block_ids: list[int] | tuple[int, ...], num_blocks: int, /
) -> tuple[int, ...] | None:
    """Sorted unique ids; None to fall back to Python; IndexError(bad_id) when one is out of range."""

def coalesce(block_ids: tuple[int, ...], /) -> tuple[tuple[int, int], ...] | None:
    """Maximal (start, length) runs; None to fall back to Python."""

def sample(block_ids: tuple[int, ...], k: int, words: bytes, /) -> list[int]:
    """k items of block_ids in their order, Floyd's draw from 8 * k random bytes (verify.py)."""

def pack(buffer: memoryview, block_ids: list[int] | tuple[int, ...], at: int, /) -> bool:
    """block_ids as native int64 from word `at`; False to fall back to struct (staging.py)."""

def call(function: int, a: int, b: int, c: int = ..., /) -> int:
    """Call int (*)(void *, void *[, void *]) at address `function` without the GIL (_driver.py)."""
