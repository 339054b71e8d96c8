"""Device-resident step metadata (jaxkv/engine/device_tables.py) equals what the host tables compute.

The host HeadPageTables stay the truth; the device mirror is updated from their journal. Every test drives
the host tables (appends of every kind, compaction, release, prefix adoption, page adoption) and checks the
device page table, lengths and slots against the host's own `append` slots and `fill_step` output.
"""

import numpy as np
import pytest

import jaxkv
from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.head_classes import HeadClass, HeadClassMap
from jaxkv.cache.tables import HeadPageTables
from jaxkv.engine.device_tables import DeviceTables
from jaxkv.engine.engine import Engine
from jaxkv.policies import get_policy
from jaxkv.sampling import SamplingParams
from tests.hf_tiny import make_tiny_checkpoint

L, H, PS, MST = 2, 3, 4, 8
SINK = np.array([[0, 2, 0], [1, 0, 0]])
WINDOW = np.array([[0, 5, 3], [6, 0, 2]])


def make(sink=SINK, window=WINDOW, pages=400, max_pages=40, rows=2):
    alloc = PageAllocator(pages)
    tables = HeadPageTables(L, H, PS, alloc, sink, window, MST)
    return tables, DeviceTables(tables, max_pages, rows)


def host_meta(tables, seq_ids, P):
    pt = np.zeros((len(seq_ids), L, H, P), np.int32)
    lens = np.zeros((len(seq_ids), L, H), np.int32)
    tables.fill_step(seq_ids, pt, lens)
    return pt, lens


def step(tables, dev, appends, P=32, through_pool=True):
    """Appends ``{seq: (first position, n)}`` on the host and checks the device step metadata."""
    seq_ids = list(appends)
    host_slots, q_seq, tok_idx = [], [], []
    for row, (sid, (p0, n)) in enumerate(appends.items()):
        host_slots.append(tables.append(sid, np.arange(p0, p0 + n), through_pool=through_pool))
        q_seq += [row] * n
        tok_idx += list(range(n))
    T = len(q_seq) + 3  # a few padding tokens
    q_seq = np.array(q_seq + [-1] * 3, np.int32)
    tok_idx = np.array(tok_idx + [0] * 3, np.int32)
    S = len(seq_ids) + 1  # and a padding row
    pt, lens, slots = dev.step_meta(seq_ids, [n for _, n in appends.values()], S, P, q_seq, tok_idx)
    want_pt, want_lens = host_meta(tables, seq_ids, P)
    np.testing.assert_array_equal(np.asarray(pt)[:-1], want_pt)
    assert (np.asarray(pt)[-1] == -1).all()
    np.testing.assert_array_equal(np.asarray(lens)[:-1], want_lens)
    assert (np.asarray(lens)[-1] == 0).all()
    slots = np.asarray(slots)
    np.testing.assert_array_equal(slots[:T - 3], np.concatenate(host_slots))
    assert (slots[T - 3:] == -1).all()
    dev.check()


def test_ragged_steps_rings_and_long_appends_match_host():
    tables, dev = make()
    step(tables, dev, {"a": (0, 7), "b": (0, 3)})
    pos = {"a": 7, "b": 3}
    for i in range(30):  # decode and small chunks: rings wrap, pages grow
        n = {"a": 1 + i % 3, "b": 1}
        step(tables, dev, {s: (pos[s], n[s]) for s in pos})
        for s in pos:
            pos[s] += n[s]
    # A fresh prompt longer than the ring (through_pool=False): overwritten ring slots are -1 on both sides.
    step(tables, dev, {"c": (0, 40)}, through_pool=False)
    tables.release("a")
    dev.check()
    step(tables, dev, {"d": (0, 5), "b": (pos["b"], 2)})  # "d" takes "a"'s row
    dev.check()


def test_multistep_decode_matches_recent_lengths_and_slots():
    tables, dev = make()
    step(tables, dev, {"a": (0, 6), "b": (0, 8)})
    K, pos = 5, {"a": 6, "b": 8}
    for it in range(6):
        n = {"a": K, "b": 1 + it % K}
        host = {s: tables.append(s, np.arange(pos[s], pos[s] + n[s])) for s in pos}
        meta = dev.decode_meta(["a", "b"], [n["a"], n["b"]], 4, 16, K)
        pt, slots, lens, prev, active = map(np.asarray, meta)
        np.testing.assert_array_equal(pt[:2], host_meta(tables, ["a", "b"], 16)[0])
        for row, s in enumerate(["a", "b"]):
            m = n[s]
            np.testing.assert_array_equal(active[:, row], np.arange(K) < m)
            np.testing.assert_array_equal(slots[:m, row], host[s])
            recent = tables.recent_lengths(s, m + 1)
            np.testing.assert_array_equal(lens[:m, row], recent[1:])
            np.testing.assert_array_equal(prev[:m, row], recent[:-1])
            assert (slots[m:, row] == -1).all() and (lens[m:, row] == 0).all()
            pos[s] += m
        assert not active[:, 2:].any() and (slots[:, 2:] == -1).all()
        dev.check()


def test_compaction_release_and_adoption_reach_the_device():
    sink, window = np.zeros((L, H), int), np.zeros((L, H), int)  # all global: adoption allowed
    tables, dev = make(sink, window, rows=1)
    step(tables, dev, {"a": (0, 8)})
    step(tables, dev, {"a": (8, 8)})
    counts = np.array([[3, 16, 9], [0, 5, 16]])
    assert tables.compact("a", counts) > 0
    step(tables, dev, {"a": (16, 2)})  # counters restart from the compacted lengths
    blocks = [tables.page_lists("a")[0][0][:1].repeat(L * H).reshape(L, H)]
    tables.adopt_prefix("p", blocks, PS)  # a second live sequence: the device grows a row
    step(tables, dev, {"p": (PS, 3), "a": (18, 1)})
    table = np.stack([np.array(tables.allocator.allocate(L * H * 2)).reshape(L, H, 2)])[0]
    tables.adopt_pages("r", table, 7, 6)
    step(tables, dev, {"r": (7, 2), "p": (PS + 3, 1)})
    for s in ("a", "p", "r"):
        tables.release(s)
    dev.check()
    assert (np.asarray(dev.table) == -1).all()
    assert tables.allocator.num_free == tables.allocator.num_pages


def test_released_row_is_cleared_whole_and_taken_again_within_one_flush():
    """A finished sequence's row is cleared in one call, its unflushed writes are dropped, and a new sequence
    on the same row keeps only its own pages: no stale page id survives, flushed or not."""
    tables, dev = make(np.zeros((L, H), int), np.zeros((L, H), int), rows=1)
    step(tables, dev, {"a": (0, 30)})                   # flushed: a holds pages on the device
    tables.append("b", np.arange(0, 20))                # b takes the second row, not flushed yet
    tables.release("b")                                 # b's pending writes must not reach the device
    tables.release("a")
    step(tables, dev, {"c": (0, 3)})                    # c takes a's row (freed last): cleared, then c's
    assert dev._row["c"] == 1
    rows = np.asarray(dev.table)
    assert rows[1][rows[1] >= 0].size == tables.pages_per_head().sum()  # c's pages only
    assert (rows[2] == -1).all()
    tables.release("c")
    dev.check()
    assert (np.asarray(dev.table) == -1).all()
    assert tables.allocator.num_free == tables.allocator.num_pages


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-devtables")))


@pytest.mark.parametrize("kind", ["global", "local", "policy"])
def test_engine_mirror_stays_equal_under_preemption_and_compression(llama, kind):
    cfg = llama.config
    kw = {}
    if kind == "local":
        row = (HeadClass.global_(),) + (HeadClass.local(2, 6),) * (cfg.num_kv_heads - 1)
        kw["head_classes"] = HeadClassMap(cfg.num_layers, cfg.num_kv_heads, (row,) * cfg.num_layers)
    if kind == "policy":
        kw.update(kv_policy=get_policy("snapkv", budget=8, window=4, sink=2), attn_impl="reference")
    # A pool too small for all requests at once: preemption, readmission, prefix cache eviction.
    per_seq = cfg.num_layers * cfg.num_kv_heads * 8
    eng = Engine(llama, page_size=4, max_model_len=32, max_num_seqs=4, max_step_tokens=8, decode_steps=4,
                 num_pages=int(per_seq * 1.5), **kw)
    rng = np.random.default_rng(1)
    sps = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True) for m in (12, 5, 9, 14, 3)]
    for sp, n in zip(sps, (10, 17, 4, 12, 9)):
        eng.add_request(rng.integers(3, cfg.vocab_size, size=n).tolist(), sp)
    while eng.has_unfinished():
        eng.step()
        eng.device_tables.check()
    if kind == "global":
        assert eng.scheduler.num_preemptions > 0 and eng.prefix is not None
    if kind == "policy":
        assert eng.compressor.pages_freed > 0
    assert (np.asarray(eng.device_tables.table) == -1).all()
