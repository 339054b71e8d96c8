"""SpeContext's progressive offload: under pool pressure, running requests' older pages of the layers the
selection serves move to host-only pages instead of a request being preempted; the tokens do not change,
and every page (device and host) comes back."""

import numpy as np
import pytest

from jaxkv.cache.allocator import OutOfPages, PageAllocator
from jaxkv.policies.retrieve import specontext as sc
from tests.test_specontext import _engine_run, _prompt, toy  # noqa: F401  (toy: the module's fixture)


def test_allocator_host_pages_are_their_own_stack():
    a = PageAllocator(4, host_pages=3)
    assert a.num_free == 4 and a.num_free_host == 3
    dev = a.allocate(4)
    host = a.allocate_host(2)
    assert set(dev) == {0, 1, 2, 3} and set(host) <= {4, 5, 6}
    with pytest.raises(OutOfPages):
        a.allocate(1)  # host pages are never handed out as device pages
    with pytest.raises(OutOfPages):
        a.allocate_host(2)
    a.decref(np.concatenate([dev[:1], host]))
    assert a.num_free == 1 and a.num_free_host == 3
    assert a.allocate(1)[0] == dev[0]
    with pytest.raises(ValueError, match="out of range"):
        a.decref([7])


@pytest.mark.parametrize("host_pages", [0, 64])
def test_offload_replaces_preemption_and_keeps_the_tokens(toy, host_pages):  # noqa: F811
    from jaxkv.policies.retrieve import decode

    model, head = toy
    pol = sc.SpeContext(budget=6, sink=1, recent=1)
    a, b = _prompt(model, 50, 0), _prompt(model, 37, 1)
    want = [decode.generate(model, pol, head, p, 12)["token_ids"] for p in (a, b)]
    got, eng = _engine_run(model, [(a, pol, None), (b, pol, None)], num_pages=140, decode_steps=2,
                           retrieval_host_tier=True, retrieval_host_pages=host_pages)
    assert eng.allocator.num_free_host == host_pages  # every host page came back too
    if host_pages:
        assert eng.retriever.buffers.pages_offloaded > 0 and eng.scheduler.num_preemptions == 0
        assert got == want  # offloaded pages are read from host memory: the same selection, same tokens
        # The lazy host tier reads in place until the offload, then loads from host memory. `steps` counts
        # every step but each request's first; eager loads would count those two among `host_steps` too.
        r = eng.retriever.buffers
        assert 0 < r.host_steps <= r.steps and r.host_rows_moved > 0
    else:  # the same load without host pages preempts a request (its recompute samples one token with
        # full attention, docs/specontext.md, so its tokens may differ from the library decode's)
        assert eng.retriever.buffers.pages_offloaded == 0 and eng.scheduler.num_preemptions > 0


def test_offload_headroom_serves_many_reservations_per_pass(toy):  # noqa: F811
    """An offload pass frees `offload_headroom` pages beyond its need, so later reservations find room
    without another pass (each pass scans every running request's tables and copies on the host): fewer
    passes for the same load, the same tokens, no preemption."""
    model, _ = toy
    pol = sc.SpeContext(budget=6, sink=1, recent=1)
    reqs = [(_prompt(model, 50, 0), pol, None), (_prompt(model, 37, 1), pol, None)]
    runs = {}
    for headroom in (0, 16):
        def setup(eng, h=headroom):
            eng.scheduler.offload_headroom = h
        runs[headroom] = _engine_run(model, reqs, num_pages=140, decode_steps=2, retrieval_host_tier=True,
                                     retrieval_host_pages=64, setup=setup)
    (tok0, e0), (tok16, e16) = runs[0], runs[16]
    assert tok0 == tok16
    assert e0.scheduler.num_preemptions == e16.scheduler.num_preemptions == 0
    assert 0 < e16.retriever.buffers.offload_passes < e0.retriever.buffers.offload_passes


def test_offload_needs_the_host_tier(toy):  # noqa: F811
    from jaxkv.engine.engine import Engine

    model, _ = toy
    with pytest.raises(ValueError, match="retrieval_host_tier"):
        Engine(model, page_size=4, max_model_len=64, retrieval_host_pages=8)
    with pytest.raises(ValueError, match="retrieval_host_pages"):
        Engine(model, page_size=4, max_model_len=64, retrieval_host_tier=True, retrieval_host_pages=-1)


def test_offload_moves_mirror_rows_deepest_layer_first(toy):  # noqa: F811
    """A direct offload mid-decode: the deepest selected layer's oldest pages get host ids whose mirror rows
    hold the device pages' K/V; the pages the step is writing and the dense layer stay; decoding then gives
    the library decode's tokens and every page returns."""
    from jaxkv.engine.engine import Engine
    from jaxkv.policies.retrieve import decode
    from jaxkv.sampling import SamplingParams

    model, head = toy
    pol = sc.SpeContext(budget=6, sink=1, recent=1)
    a = _prompt(model, 50, 0)
    eng = Engine(model, page_size=4, max_model_len=128, max_num_seqs=2, max_step_tokens=16, decode_steps=2,
                 enable_prefix_caching=False, retrieval_host_tier=True, retrieval_host_pages=32)
    rid = eng.add_request(a, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), kv_policy=pol)
    got = []
    while eng._requests[rid].num_computed <= len(a) + 2:
        for o in eng.step():
            got += o.new_token_ids
    before = eng.tables.page_lists(rid)
    d = eng.runner.pool.k.shape[-1]
    pool_k = np.asarray(eng.runner.pool.k).reshape(-1, d)
    safe = (eng._requests[rid].num_computed - 2 * 2 - 4) // 4  # pages written by dispatched calls (margin)
    assert eng.retriever.buffers.offload(6) == 6
    after = eng.tables.page_lists(rid)
    ps, dev = eng.page_size, eng.allocator.num_pages
    host_k = np.asarray(eng.retriever.buffers._host[0])
    moved, pages = 0, []
    for layer in range(model.config.num_layers):
        for h in range(model.config.num_kv_heads):
            for j, (old, new) in enumerate(zip(before[layer][h], after[layer][h], strict=True)):
                if old == new:
                    continue
                assert layer == model.config.num_layers - 1 and old < dev <= new and j < safe
                np.testing.assert_array_equal(host_k[new * ps:(new + 1) * ps],
                                              pool_k[old * ps:(old + 1) * ps])
                moved += 1
                pages.append(j)
    assert sorted(pages) == [0, 0, 1, 1, 2, 2]  # oldest first, over both heads of the layer
    assert moved == 6 and eng.allocator.num_free_host == 32 - 6
    st = eng.stats()
    assert (st.host_pages_total, st.host_pages_in_use, st.pages_offloaded) == (32, 6, 6)
    # The buffer forgets its rows: the next step reloads every selected row, the offloaded ones from their
    # host pages (the path a long decode takes as its selection drifts).
    eng.retriever.buffers._owner.clear()
    while eng.has_unfinished():
        for o in eng.step():
            got += o.new_token_ids
    assert got == decode.generate(model, pol, head, a, 12)["token_ids"]
    assert eng.allocator.num_free == eng.allocator.num_pages and eng.allocator.num_free_host == 32
