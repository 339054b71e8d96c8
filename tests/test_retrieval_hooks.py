"""Retrieval methods defined outside the package plug into the engine through the policy hooks only: a
layer-wise one (`layer_wise`, `page_state`, `read_pages`, `tap_layer`), whose per-page state the engine keeps
and updates and whose pages it reads, and a shared one (`for_model`, `scores` / `score_rows`), whose one
selection per step every later layer reads."""

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


@dataclasses.dataclass(frozen=True)
class NewestSlots(RetrievalPolicy):
    """A shared method without parameters: after the first layer each KV head reads the newest `budget`
    positions its state saw written (state: [rows, slots] bool; a slot never recorded scores -inf, so a
    state the engine failed to keep picks the oldest slots instead)."""

    name = "newest-slots"
    num_kv_heads: int = 0  # resolved from the model (`for_model`)

    def for_model(self, model):
        return dataclasses.replace(self, num_kv_heads=model.config.num_kv_heads)

    def tap_layer(self, head) -> int:
        return 1

    def init_state(self, head, num_seqs: int, max_len: int):
        return jnp.zeros((num_seqs, max_len), bool)

    def observe(self, head, state, x, positions):
        return state.at[jnp.arange(state.shape[0])[:, None], positions].set(True, mode="drop")

    def observe_tokens(self, head, state, x, positions, rows):
        return state.at[jnp.where(rows >= 0, rows, state.shape[0]), positions].set(True, mode="drop")

    def scores(self, head, state, x, positions):
        state = self.observe(head, state, x, positions)  # the library decode: the step's token first
        return self._newest(state), state

    def score_rows(self, head, state, x, positions, rows, num_slots):
        return self._newest(state[rows, :num_slots])

    def _newest(self, seen):
        s, n = seen.shape
        score = jnp.where(seen, jnp.arange(n, dtype=jnp.float32), -jnp.inf)
        return jnp.broadcast_to(score[:, None], (s, self.num_kv_heads, n))


def test_a_shared_method_outside_the_package_equals_its_library_decode(toy):  # noqa: F811
    from jaxkv.policies.retrieve import decode

    ids = _prompt(toy, 45, 9)
    pol = NewestSlots(budget=6)
    want = decode.generate(toy, pol, None, ids, 10)["token_ids"]
    (full,) = _run(toy, [(ids, None, None)])
    for inplace in (True, False):  # in place in the pool, and through the selection buffer
        (got,) = _run(toy, [(ids, pol, None)], decode_steps=3, retrieval_inplace=inplace)
        assert got == want
    assert want != full


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
