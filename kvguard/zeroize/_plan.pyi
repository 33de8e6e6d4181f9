"""Stub of the optional C extension built from _plan.c; see that file and plan.py."""

def unique_sorted(
    block_ids: list[int] | tuple[int, ...], num_blocks: int, /
) -> tuple[int, ...] | None:
    """Sorted unique ids; None to fall back to Python; IndexError(bad_id) when one is out of range."""

def coalesce(block_ids: tuple[int, ...], /) -> tuple[tuple[int, int], ...] | None:
    """Maximal (start, length) runs; None to fall back to Python."""
