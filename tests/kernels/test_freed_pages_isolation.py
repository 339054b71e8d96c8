"""Freed pages are never read before they are rewritten (tenant isolation).

The allocator hands a freed page to the next request as it is: its slots still hold another request's
K/V and positions until they are overwritten. Paged attention must read only the slots below each head's
length in the pages of its own table. Here every page outside the tables (page 0 among them) and every
slot past a head's length holds another request's K/V and a stale position the causal mask would accept
(0); outputs must equal the clean pool's exactly.

The kernels do load masked slots (the tail of a head's last page, and page 0 behind padding page-table
entries) but weight them by exactly 0 and select V by the slot mask first, so neither finite stale values
nor non-finite ones (0 * NaN = NaN) reach the output.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention.api import paged_attention
from tests.kernels._data import random_paged_case

ARGS = ("q", "k_pages", "v_pages", "slot_pos", "page_table", "lengths", "q_seq", "q_pos")
FREE_PAGES = 5

CASES = [  # (q_lens, ordered, num_splits, block_q)
    ((1, 1, 1), False, 1, None),      # decode, every page scanned
    ((1, 1, 1), True, 3, None),       # decode, page-range skipping, split-K
    ((6, 3, 0), True, 2, 4),          # chunked prefill
    ((1, 2, 1), True, 4, 1),          # one-token blocks
]


def pools(c: dict, nan: bool):
    """(clean, dirty) pools: the case's pages moved up by FREE_PAGES so that free pages include page 0
    (where padding page-table entries point). In `dirty`, every free page and every slot past a head's
    length holds a stale position 0 and another request's K/V: large random values, or NaN."""
    p, d = c["k_pages"].shape[1:]
    rng = np.random.default_rng(1)
    clean = dict(c, page_table=np.where(c["page_table"] >= 0, c["page_table"] + FREE_PAGES, -1))
    for k in ("k_pages", "v_pages"):
        clean[k] = np.concatenate([np.zeros((FREE_PAGES, p, d), c[k].dtype), c[k]])
    clean["slot_pos"] = np.concatenate([-np.ones((FREE_PAGES, p), np.int32), c["slot_pos"]])
    dirty = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in clean.items()}
    owned = np.zeros(len(clean["slot_pos"]), bool)
    s, h, _ = c["page_table"].shape
    for i in range(s):
        for j in range(h):
            n = int(c["lengths"][i, j])
            pages = clean["page_table"][i, j, : (n + p - 1) // p]
            owned[pages] = True
            if n % p:  # the slots past the head's length in its last page
                stale = np.nan if nan else rng.standard_normal((p - n % p, d)) * 100
                dirty["k_pages"][pages[-1], n % p:] = stale
                dirty["v_pages"][pages[-1], n % p:] = stale
                dirty["slot_pos"][pages[-1], n % p:] = 0
    for k in ("k_pages", "v_pages"):
        dirty[k][~owned] = np.nan if nan else rng.standard_normal(dirty[k][~owned].shape) * 100
    dirty["slot_pos"][~owned] = 0
    assert not owned[:FREE_PAGES].any()
    return clean, dirty


def run_both(implementation, case, nan):
    q_lens, ordered, splits, block_q = case
    c = random_paged_case(np.random.default_rng(hash(case) % 2**32), q_lens=q_lens)
    clean, dirty = pools(c, nan)
    sink, window = jnp.array([0, 2], jnp.int32), jnp.array([0, 5], jnp.int32)
    kw = dict(ordered=ordered, num_splits=splits, block_q=block_q) if implementation == "pallas" else {}

    def run(x):
        out, lse = paged_attention(*[jnp.asarray(x[a]) for a in ARGS], sink, window, scale=0.25,
                                   implementation=implementation, **kw)
        return np.asarray(out), np.asarray(lse)

    return run(clean), run(dirty)


@pytest.mark.parametrize("implementation", ["pallas", "reference"])
@pytest.mark.parametrize("case", CASES)
def test_stale_data_in_free_pages_and_slots_never_reaches_the_output(implementation, case):
    (out_clean, lse_clean), (out_dirty, lse_dirty) = run_both(implementation, case, nan=False)
    assert np.isfinite(out_dirty).all()
    np.testing.assert_array_equal(out_dirty, out_clean)
    np.testing.assert_array_equal(lse_dirty, lse_clean)


@pytest.mark.parametrize("implementation", ["pallas", "reference"])
@pytest.mark.parametrize("case", CASES)
def test_nan_in_free_pages_and_stale_slots_does_not_reach_the_output(implementation, case):
    (out_clean, _), (out_dirty, _) = run_both(implementation, case, nan=True)
    assert np.isfinite(out_dirty).all()
    np.testing.assert_array_equal(out_dirty, out_clean)
