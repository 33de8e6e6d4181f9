"""The sample draw of `verify="sample"` (verify.py, `_plan.sample`): which blocks are read back.

What the sample is for (docs/zeroize.md): a read-back of a few blocks, every layer of each, that an
operator cannot predict, so an executor that skipped a layer, a half or a tail is caught. The tests
hold the C and Python draws equal, check that every k-subset is equally likely, and that a seed
reproduces its picks while the unseeded generator does not repeat itself.
"""

from __future__ import annotations

import itertools
import random
import struct
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.errors import ZeroizeError
from kvguard.zeroize import plan_zeroize, verify
from kvguard.zeroize.verify import _sample_python, draw_sample, sample_blocks

needs_native = pytest.mark.skipif(verify._native is None, reason="the C extension is not built")


@st.composite
def draws(draw: st.DrawFn) -> tuple[tuple[int, ...], int, bytes]:
    n = draw(st.integers(min_value=2, max_value=300))
    ids = tuple(sorted(draw(st.sets(st.integers(0, 10**6), min_size=n, max_size=n))))
    k = draw(st.integers(min_value=1, max_value=n - 1))
    words = draw(st.one_of(
        st.binary(min_size=8 * k, max_size=8 * k),
        st.just(b"\xff" * 8 * k),  # every step at the top of its range
        st.just(b"\x00" * 8 * k),  # every step at position 0: Floyd's collisions
    ))  # fmt: skip
    return ids, k, words


@needs_native
@given(draws())
def test_the_c_draw_is_the_python_draw(case: tuple[tuple[int, ...], int, bytes]) -> None:
    ids, k, words = case
    picked = draw_sample(ids, k, words)
    assert picked == _sample_python(ids, k, words)
    assert len(set(picked)) == k and set(picked) <= set(ids) and picked == sorted(picked)


def test_floyd_steps_on_known_words() -> None:
    """Step i picks floor(word * (j + 1) / 2**64) for j = n - k + i, or j after a collision."""
    ids = tuple(range(100, 110))  # n = 10
    zeros = bytes(8 * 3)  # k = 3: j = 7, 8, 9; position 0, then 0 again (-> 8), then 0 (-> 9)
    assert draw_sample(ids, 3, zeros) == _sample_python(ids, 3, zeros) == [100, 108, 109]
    top = b"\xff" * 24  # floor((2**64 - 1) * (j + 1) / 2**64) = j: positions 7, 8, 9
    assert draw_sample(ids, 3, top) == [107, 108, 109]
    half = struct.pack("<3Q", 1 << 63, 1 << 63, 1 << 63)  # (j + 1) // 2: 4, then 4 again (-> 8), 5
    assert draw_sample(ids, 3, half) == _sample_python(ids, 3, half) == [104, 105, 108]


@pytest.mark.parametrize("draw", [draw_sample, _sample_python], ids=["default", "python"])
def test_every_subset_is_equally_likely(draw: object) -> None:
    """6 choose 3 = 20 subsets, 12,000 draws: each count within 5 standard deviations of 600."""
    chooser = random.Random(2026)
    ids = tuple(range(6))
    counts = Counter(
        tuple(draw(ids, 3, chooser.randbytes(24)))  # type: ignore[operator]
        for _ in range(12_000)
    )
    assert set(counts) == set(itertools.combinations(ids, 3))
    sd = (12_000 * (1 / 20) * (19 / 20)) ** 0.5
    assert all(abs(count - 600) < 5 * sd for count in counts.values()), counts


def test_a_seed_reproduces_its_sample_and_no_seed_is_unpredictable() -> None:
    plan = plan_zeroize(range(0, 4096, 7), 4096)
    seeded = sample_blocks(plan, 8, seed=11)
    assert seeded == sample_blocks(plan, 8, seed=11) and len(set(seeded)) == 8
    assert set(seeded) <= set(plan.block_ids) and seeded == sorted(seeded)
    assert sample_blocks(plan, 8, seed=12) != seeded
    unseeded = [tuple(sample_blocks(plan, 8, seed=None)) for _ in range(50)]
    assert len(set(unseeded)) == 50  # C(586, 8) subsets: a repeat means a stuck generator


def test_small_plans_and_bad_sizes() -> None:
    plan = plan_zeroize([5, 1, 3], 8)
    assert sample_blocks(plan, 3, None) == sample_blocks(plan, 9, 1) == [1, 3, 5]
    with pytest.raises(ZeroizeError):
        sample_blocks(plan, 0, None)
    for bad_k, words in ((0, b""), (3, bytes(24)), (1, bytes(7))):
        with pytest.raises(ValueError):
            draw_sample((1, 3, 5), bad_k, words)
        with pytest.raises(ValueError):
            _sample_python((1, 3, 5), bad_k, words)
