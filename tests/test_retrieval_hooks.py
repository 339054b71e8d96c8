"""A retrieval method defined outside the package plugs into the engine through the policy hooks only
(`layer_wise`, `page_state`, `read_pages`, `tap_layer`): the engine keeps and updates its per-page state and
reads the pages it picks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.policies.retrieve.base import RetrievalPolicy
from jaxkv.policies.retrieve.quest import Quest
from tests.test_quest import _prompt, _run, toy  # noqa: F401


class PageWrites:
    """Slots written per page (a page's first slot resets it), [num_pages] int32."""

    @staticmethod
    def init(num_pages: int, head_dim: int, dtype):
        return jnp.zeros((num_pages,), jnp.int32)

    @staticmethod
    def update(counts, k, slots, page_size: int):
        n = counts.shape[0]
        flat = slots.reshape(-1)
        page = jnp.where(flat >= 0, flat // page_size, n)
        first = jnp.where((flat >= 0) & (flat % page_size == 0), page, n)
        return counts.at[first].set(0, mode="drop").at[page].add(1, mode="drop")


@dataclasses.dataclass(frozen=True)
class RecentPages(RetrievalPolicy):
    """Reads the newest budget // page_size pages of each head after the first layer, and of each page only
    the slots its write count says hold keys (a state the engine failed to update reads nothing)."""

    name = "recent-pages"
    layer_wise = True
    page_state = PageWrites

    def tap_layer(self, head) -> int:
        return 1

    def read_pages(self, counts, page_table, lengths, q, q_pos, page_size: int):
        n = min(max(1, self.budget // page_size), page_table.shape[-1])
        npages = (lengths + page_size - 1) // page_size  # [S, Hkv]
        j = jnp.maximum(npages[..., None] - n + jnp.arange(n), 0)  # the newest n entries (clamped)
        real = (jnp.arange(n) >= n - npages[..., None])  # fewer than n pages: the clamped ones are not
        pages = jnp.maximum(jnp.take_along_axis(page_table, j, axis=-1), 0)
        keep = real[..., None] & (jnp.arange(page_size) < counts[pages][..., None])
        return pages, keep


def test_a_method_outside_the_package_reads_its_own_pages_with_its_own_state(toy):  # noqa: F811
    ids = _prompt(toy, 45, 7)
    # Quest forcing its 9 recent positions with 3 pages of 4 reads exactly the 3 newest pages of each head
    quest = Quest(budget=12, recent=9, dense_layers=1)
    (got,) = _run(toy, [(ids, RecentPages(budget=12), None)], decode_steps=3)
    (want,) = _run(toy, [(ids, quest, None)], decode_steps=3)
    (full,) = _run(toy, [(ids, None, None)])
    assert got == want and got != full


def test_the_engine_keeps_the_method_page_state_equal_to_the_pool(toy):  # noqa: F811
    from jaxkv.engine.engine import Engine
    from jaxkv.sampling import SamplingParams

    eng = Engine(toy, page_size=4, max_model_len=128, max_num_seqs=4, max_step_tokens=16,
                 enable_prefix_caching=False, decode_steps=3)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    rid = eng.add_request(_prompt(toy, 37, 8), sp, kv_policy=RecentPages(budget=8))
    for _ in range(8):
        eng.step()
    assert rid in eng.tables
    counts = np.asarray(jax.device_get(eng.retriever._page_states[PageWrites]))
    lists, lengths = eng.tables.page_lists(rid), eng.tables.lengths(rid)
    for layer, row in enumerate(lists):
        for h, pages in enumerate(row):
            for j, page in enumerate(pages):
                assert counts[page] == min(eng.page_size, int(lengths[layer, h]) - j * eng.page_size)
