"""Segment tiers on the real engine (tiny random llama, CPU): a pool too small for every registered segment
serves requests over all of them with the tokens of a large pool and no segment prefilled twice; least
recently used segments leave the device first; frozen ones stay where they were pinned; RedKnot's promotion
moves only the heads it reads; the store tier; cards and metrics show the tiers."""

import time

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv.cache.head_classes import HeadClass, HeadClassMap, all_global
from jaxkv.cache.segments import SegmentError
from jaxkv.engine.engine import Engine
from jaxkv.engine.segment_tiers import SegmentCapacityError, SegmentTiers
from jaxkv.policies.reuse import get_reuse_policy
from jaxkv.policies.reuse.apply import reuse_prefill
from jaxkv.sampling import SamplingParams
from jaxkv.serve import kv as K
from jaxkv.serve.metrics import ServeMetrics
from tests.hf_tiny import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SEG = 16  # tokens per segment: 4 pages per (layer, KV head) at page size 4
PREFIX, SUFFIX = [5, 6, 7], [9, 10, 11]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-tiers")))


@pytest.fixture(scope="module")
def docs(model):
    rng = np.random.default_rng(3)
    return [rng.integers(3, model.config.vocab_size, SEG).tolist() for _ in range(4)]


def engine(model, num_pages, **kw):
    cfg = model.config
    return Engine(model, page_size=4, max_model_len=64, num_pages=num_pages, attn_impl="reference",
                  head_classes=all_global(cfg.num_layers, cfg.num_kv_heads), **kw)


def seg_pages(model) -> int:
    return model.config.num_layers * model.config.num_kv_heads * SEG // 4


def ask(eng, segments, method="naive"):
    rid = eng.add_reuse_request(PREFIX, segments, SUFFIX, reuse=method, sampling=GREEDY)
    out = []
    for _ in range(100):
        if not eng.has_unfinished():
            break
        out += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    assert len(out) == GREEDY.max_tokens, "the request never ran"
    return out


def where(eng, sid):
    return eng.reuser.tiers.tiers(eng.reuser.store.get(sid))


COMBOS = [[0, 1], [2, 3, 1], [0, 2], [0, 2, 3], [3, 1], [1, 2, 0]]


def test_a_small_pool_serves_every_segment_like_a_large_one(model, docs):
    # 7 segments' pages: every segment, or three beside a request over three, never both
    big, small = engine(model, 2000), engine(model, 7 * seg_pages(model))
    ids_big = [big.register_segment(d) for d in docs]
    ids = [small.register_segment(d) for d in docs]
    assert ids == ids_big
    tiers = small.reuser.tiers
    for combo in COMBOS:
        for method in ("naive", "redknot"):
            want = ask(big, [ids[i] for i in combo], method)
            assert ask(small, [ids[i] for i in combo], method) == want, (combo, method)
    # The small pool cannot hold every segment beside a request: segments moved, none was prefilled again.
    assert tiers.demotions > 0 and tiers.promotions > 0 and tiers.bytes_promoted > 0
    assert small.reuser.segments_prefilled == len(docs) == big.reuser.segments_prefilled
    assert big.reuser.tiers.demotions == 0
    assert any("host" in where(small, s) and "device" not in where(small, s) for s in ids)
    # Registering a segment again finds it in whatever tier holds it.
    assert small.register_segment(docs[0]) == ids[0] and small.reuser.segments_prefilled == len(docs)
    # Pages: every device page a segment holds is one the allocator counts as taken, none leaked.
    small.reuser.store.clear()
    assert small.allocator.num_free == small.allocator.num_pages


def test_least_recently_used_segments_leave_the_device_first(model, docs):
    P = seg_pages(model)
    # Room for three segments and a request over one of them, not for a fourth (longer) segment.
    eng = engine(model, 3 * P + 28)
    a, b, c = (eng.register_segment(d) for d in docs[:3])
    ask(eng, [a])  # a is now the most recently used; b the least
    assert all(where(eng, s) == ["device"] for s in (a, b, c))
    d = eng.register_segment(docs[3] + docs[0][:12])  # needs pages: the least recently used idle one goes
    assert where(eng, b) == ["host"] and where(eng, d) == ["device"]
    assert where(eng, a) == ["device"] and where(eng, c) == ["device"]
    assert eng.reuser.tiers.evict(1) == P and where(eng, c) == ["host"]  # next: c, then a
    assert eng.reuser.tiers.evict(1) == P and where(eng, a) == ["host"]
    ask(eng, [b])  # promoted back; its host copy stays (a later demotion copies nothing)
    assert where(eng, b) == ["device", "host"]
    demoted = eng.reuser.tiers.bytes_demoted
    eng.reuser.tiers.evict(eng.allocator.num_pages)
    assert eng.reuser.tiers.bytes_demoted == demoted + eng.reuser.tiers.tier_bytes(
        eng.reuser.store.get(d))["host"]  # only d (never demoted before) was copied


def test_frozen_segments_stay_in_their_pinned_tier(model, docs):
    P = seg_pages(model)
    probe = engine(model, 100)
    full = probe.tables.pages_needed(None, 64)  # one request of the full context (64 tokens)
    eng = engine(model, full + P + 8)  # room for one device pin beside it
    pinned = eng.register_segment(docs[0], frozen=True)
    kept = eng.register_segment(docs[1], frozen=True, tier="host")
    assert where(eng, pinned) == ["device"] and where(eng, kept) == ["host"]
    other = eng.register_segment(docs[2])
    assert eng.reuser.tiers.evict(eng.allocator.num_pages) == P  # only the unpinned one can go
    assert where(eng, pinned) == ["device"] and where(eng, other) == ["host"]
    ask(eng, [kept, other])  # a host-pinned segment is promoted for a request like any other
    eng.reuser.tiers.evict(eng.allocator.num_pages)
    assert where(eng, pinned) == ["device"] and where(eng, kept) == ["host"]
    with pytest.raises(SegmentCapacityError, match="frozen on the device"):
        eng.register_segment(docs[3], frozen=True)  # a second device pin would crowd out a full request
    with pytest.raises(ValueError, match="frozen=True"):
        eng.register_segment(docs[3], tier="host")
    with pytest.raises(ValueError, match="tier must be one of"):
        eng.register_segment(docs[3], frozen=True, tier="disk")


def test_without_a_store_ordinary_segments_past_host_memory_go_and_frozen_ones_are_refused(model, docs):
    eng = engine(model, 2000)
    tiers = eng.reuser.tiers
    tiers.host_bytes = 2 * tiers.L * tiers.H * SEG * tiers.slot_bytes  # two segments
    ids = [eng.register_segment(d) for d in docs]  # ordinary segments are always admitted
    assert tiers.evict(eng.allocator.num_pages) == 4 * seg_pages(model)  # every one leaves the device
    # Host memory keeps the two most recently used; the two oldest had no tier left and were dropped.
    assert [where(eng, s) for s in ids[2:]] == [["host"], ["host"]] and tiers.drops == 2
    for s in ids[:2]:
        with pytest.raises(SegmentError, match="unknown"):
            eng.reuser.store.get(s)
    prefilled = eng.reuser.segments_prefilled
    ask(eng, [docs[0]])  # a request that gives the tokens registers the segment again
    assert eng.reuser.segments_prefilled == prefilled + 1
    # Frozen segments are never dropped: pinned in host memory, they must fit it together.
    eng.register_segment(docs[1], frozen=True, tier="host")
    eng.register_segment(docs[2], frozen=True, tier="host")  # drops the ordinary copies to fit
    assert tiers.host_used == tiers.host_bytes and tiers.drops == 4
    with pytest.raises(SegmentCapacityError, match="--segment-host-bytes"):
        eng.register_segment(docs[3], frozen=True, tier="host")
    eng.register_segment(docs[3], frozen=True)  # pinned to the device: no host memory needed
    with pytest.raises(ValueError, match="segment_host_bytes"):
        SegmentTiers(eng.reuser, host_bytes=-1)


def redknot_engine(model, num_pages):
    cfg = model.config
    L, H = cfg.num_layers, cfg.num_kv_heads
    hc = HeadClassMap(L, H, tuple(tuple(HeadClass.global_() if h == 0 else HeadClass.local(2, 4)
                                        for h in range(H)) for _ in range(L)))
    eng = engine(model, num_pages)
    eng.reuser.__init__(eng, reuse_head_classes=hc)
    return eng


def test_redknot_promotes_only_the_heads_it_reads(model, docs):
    redknot = get_reuse_policy("redknot")
    resident = redknot_engine(model, 2000)
    ids = [resident.register_segment(d) for d in docs[:2]]
    want = ask(resident, ids, redknot)
    moved = {}
    for method in (redknot, "naive"):
        eng = redknot_engine(model, 2000)
        assert [eng.register_segment(d) for d in docs[:2]] == ids
        tiers = eng.reuser.tiers
        tiers.evict(eng.allocator.num_pages)  # every segment off the device
        assert all(where(eng, s) == ["host"] for s in ids)
        got = ask(eng, ids, method)
        if method is redknot:  # global heads recomputed, not copied: the same tokens as all heads resident
            assert got == want
            heads = eng.reuser.store.get(ids[0]).pages[..., 0] >= 0
            assert heads.tolist() == [[False, True]] * model.config.num_layers  # the local heads only
        moved[getattr(method, "name", method)] = (tiers.bytes_promoted, tiers.bytes_promoted_all_heads)
    every = moved["naive"][1]
    assert moved["naive"] == (every, every)
    assert moved["redknot"] == (every // 2, every)  # one of two KV heads per layer is local
    ask(eng, ids, redknot)  # eng: the naive one; every head is already on the device, nothing moves
    assert eng.reuser.tiers.bytes_promoted == every


def test_the_store_tier_and_a_second_engine_on_it(model, docs, tmp_path):
    big = engine(model, 2000)
    ids = [big.register_segment(d) for d in docs]
    want = {tuple(c): ask(big, [ids[i] for i in c]) for c in COMBOS[:3]}
    # No host memory: demoted segments are only in the store and come back from it per head.
    small = engine(model, 7 * seg_pages(model), segment_store=str(tmp_path), segment_host_bytes=0)
    peer = engine(model, 2000, segment_store=str(tmp_path))  # started before the segments existed
    assert [small.register_segment(d) for d in docs] == ids
    for c, tokens in want.items():
        assert ask(small, [ids[i] for i in c]) == tokens
    tiers = small.reuser.tiers
    assert tiers.demotions > 0 and tiers.bytes_demoted == 0 and small.reuser.persist.bytes_read > 0
    assert tiers.promotions > 0  # all from the store: host memory holds nothing
    tiers.evict(small.allocator.num_pages)
    assert all(where(small, s) == ["store"] for s in ids) and tiers.host_used == 0
    assert small.reuser.segments_prefilled == len(docs)
    # The peer finds them in the store on first use, without a prefill.
    assert ask(peer, [ids[i] for i in COMBOS[0]]) == want[tuple(COMBOS[0])]
    assert peer.reuser.segments_prefilled == 0 and peer.reuser.tiers.promotions > 0
    # A restarted engine registers them without loading more than the pool holds beside a full request.
    again = engine(model, 7 * seg_pages(model), segment_store=str(tmp_path))
    assert again.segments_restored == len(docs) and again.reuser.segments_prefilled == 0
    assert ask(again, [ids[i] for i in COMBOS[1]]) == want[tuple(COMBOS[1])]
    small.delete_segment(ids[3])
    with pytest.raises(SegmentError, match="deleted"):
        small.reuser.store.get(ids[3])


def test_placing_a_segment_in_each_tier_keeps_the_answer(model, docs, tmp_path):
    """`place` puts a segment wholly in one tier (what the tier benchmark starts every run from); the next
    request promotes it from there and answers as with the segment on the device."""
    eng = engine(model, 2000, segment_store=str(tmp_path))
    ids = [eng.register_segment(d) for d in docs[:2]]
    want = ask(eng, ids)
    tiers, persist = eng.reuser.tiers, eng.reuser.persist
    entries = [eng.reuser.store.get(s) for s in ids]
    size = tiers.L * tiers.H * SEG * tiers.slot_bytes
    for tier, source in [("host", "host"), ("store", "store"), ("device", None), ("host", "host")]:
        for e in entries:
            tiers.place(e, tier)
            assert tiers.tiers(e)[0] == tier and (tier == "device") == bool(tiers.device_heads(e).all())
        assert (tiers.host_used == 2 * size) == (tier == "host")
        promoted, read = tiers.bytes_promoted, persist.bytes_read
        assert ask(eng, ids) == want
        assert tiers.bytes_promoted - promoted == (0 if source is None else 2 * size)
        assert persist.bytes_read - read == (2 * size if source == "store" else 0)
    with pytest.raises(ValueError, match="tier must be one of"):
        tiers.place(entries[0], "disk")
    plain = engine(model, 2000)
    e = plain.reuser.store.get(plain.register_segment(docs[0]))
    with pytest.raises(SegmentError, match="not in a segment store"):
        plain.reuser.tiers.place(e, "store")
    pinned = plain.reuser.store.get(plain.register_segment(docs[1], frozen=True))
    with pytest.raises(SegmentError, match="pinned"):
        plain.reuser.tiers.place(pinned, "host")


def test_cards_and_metrics_report_the_tiers(model, docs):
    eng = engine(model, 7 * seg_pages(model))
    ids = [eng.register_segment(d) for d in docs]
    for c in COMBOS[:3]:
        ask(eng, [ids[i] for i in c])
    tiers = eng.reuser.tiers
    tiers.evict(1)
    cards = {s: K.segment_card(tiers, eng.reuser.store.get(s)) for s in ids}
    per_segment = tiers.L * tiers.H * SEG * tiers.slot_bytes
    for card in cards.values():
        assert card["tiers"] and set(card["bytes"]) == {"device", "host", "store"}
        assert card["bytes"]["store"] == 0  # no store configured
        assert all(card["bytes"][t] == per_segment for t in card["tiers"])
    assert any(c["tiers"] == ["host"] for c in cards.values())
    m = ServeMetrics("tiny")
    m.set_kv_stats(eng)
    text = m.render().decode()
    totals = tiers.totals()

    def value(name, **labels):
        lab = ",".join(f'{k}="{v}"' for k, v in sorted({"model_name": "tiny", **labels}.items()))
        line = next(x for x in text.splitlines() if x.startswith(f"{name}{{{lab}}}"))
        return float(line.split()[-1])

    assert value("jaxkv_segment_bytes", tier="host") == totals["host"] > 0
    assert value("jaxkv_segment_bytes", tier="device") == totals["device"] > 0
    assert value("jaxkv_segment_promotions_total") == tiers.promotions > 0
    assert value("jaxkv_segment_demotions_total") == tiers.demotions > 0
    assert value("jaxkv_segment_bytes_moved_total", direction="promote") == tiers.bytes_promoted
    assert value("jaxkv_segment_bytes_moved_total", direction="demote") == tiers.bytes_demoted > 0


def test_host_copies_in_pinned_host_memory(model, docs):
    """The accelerator path: host copies as JAX arrays in the host memory kind (one per KV head), which
    the CPU backend offers too."""
    resident = engine(model, 2000)
    ids = [resident.register_segment(d) for d in docs[:2]]
    want = ask(resident, ids)
    eng = engine(model, 2000)
    eng.reuser.tiers.memory_kinds = True
    assert [eng.register_segment(d) for d in docs[:2]] == ids
    eng.reuser.tiers.evict(eng.allocator.num_pages)
    copy = eng.reuser.tiers._host[ids[0]]
    assert isinstance(copy.k, list) and copy.k[0].sharding.memory_kind.endswith("host")
    assert ask(eng, ids) == want
    assert all(where(eng, s) == ["device", "host"] for s in ids)


def test_a_store_read_of_some_heads_reads_and_checks_only_theirs(tmp_path):
    import json

    from jaxkv.cache.segment_store import CorruptSegmentError, SegmentStore, StoredSegment

    store = SegmentStore(tmp_path, {"model": "tiny"})
    L, H, S, D = 2, 2, 8, 4
    k = np.random.default_rng(0).normal(size=(L, H, S, D)).astype(np.float32)
    pos = np.broadcast_to(np.arange(S, dtype=np.int32), (L, H, S)).copy()
    store.put(StoredSegment("seg-x", (1, 2), None, k, -k, pos, np.ones((L, H), bool)))
    chunk = tmp_path / "segments" / "seg-x" / "k" / "c" / "0" / "1" / "0" / "0"  # layer 0, KV head 1
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))
    local = np.zeros((L, H), bool)
    local[:, 0] = True  # e.g. the heads a method reads: the damaged chunk is not among them
    got = store.get("seg-x", heads=local)
    np.testing.assert_array_equal(got.k[:, 0], k[:, 0])
    with pytest.raises(CorruptSegmentError, match="checksum"):
        store.get("seg-x")
    with pytest.raises(CorruptSegmentError, match="checksum"):
        store.get("seg-x", heads=~local)
    # A segment written before per-chunk checksums (one blake2b of every stored chunk, k then v then pos):
    # every stored head is read against the segment's one.
    import hashlib

    meta_path = tmp_path / "segments" / "seg-x" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["chunk_checksums"]
    digest = hashlib.blake2b(digest_size=16)
    for a in (k, -k, pos):
        for layer in range(L):
            for head in range(H):
                digest.update(np.ascontiguousarray(a[layer, head]).tobytes())
    meta["checksum"] = digest.hexdigest()
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CorruptSegmentError, match="checksum"):
        store.get("seg-x", heads=local)
    chunk.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 0xFF]))  # repaired: the old format reads back
    np.testing.assert_array_equal(store.get("seg-x").k, k)


def test_a_queued_request_reads_its_segments_from_the_store_ahead(model, docs, tmp_path, monkeypatch):
    """A reuse request over segments only the store holds starts their store read when it is queued; its
    promotion then uses that read (no second read) and the answer is the one from the device."""
    eng = engine(model, 2000, segment_store=str(tmp_path))
    ids = [eng.register_segment(d) for d in docs[:2]]
    want = ask(eng, ids)
    tiers = eng.reuser.tiers
    for s in ids:
        tiers.place(eng.reuser.store.get(s), "store")
    disk = eng.reuser.persist.disk
    reads = []
    real_read = disk.read
    monkeypatch.setattr(disk, "read", lambda sid, heads=None: reads.append(sid) or real_read(sid, heads))
    rid = eng.add_reuse_request(PREFIX, ids, SUFFIX, reuse="naive", sampling=GREEDY)
    assert set(tiers._reads) == set(ids)
    for _, read in tiers._reads.values():
        read.wait()  # the reads finish before the engine steps: they ran while the request was queued
    assert sorted(reads) == sorted(ids)
    out = []
    while eng.has_unfinished():
        out += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    assert out == want and sorted(reads) == sorted(ids) and tiers.prefetch_hits == 2 and not tiers._reads
    # without a store nothing is read ahead
    plain = engine(model, 2000)
    plain.add_reuse_request(PREFIX, [plain.register_segment(docs[0])], SUFFIX, reuse="naive", sampling=GREEDY)
    assert not plain.reuser.tiers._reads


def test_the_reuse_head_class_map_can_be_given_to_the_engine(model, tmp_path):
    """`segment_head_classes` (a map or a path) sets RedKnot's global / local heads for a model without a
    head_classes.json beside it; RedKnot then promotes only the local heads."""
    cfg = model.config
    row = tuple(HeadClass("global") if h == 0 else HeadClass.local(4, 8) for h in range(cfg.num_kv_heads))
    rows = tuple(row for _ in range(cfg.num_layers))
    path = tmp_path / "reuse_heads.json"
    HeadClassMap(cfg.num_layers, cfg.num_kv_heads, rows).save(path)
    eng = engine(model, 2000, segment_head_classes=str(path))
    assert eng.reuser.heads["is_global"][:, 0].all() and not eng.reuser.heads["is_global"][:, 1:].any()
    assert (eng.reuser.heads["window"][:, 1:] == 8).all()
    assert not engine(model, 2000).reuser.heads["window"].any()  # default: the engine's (all global)


def test_pinned_host_copies_move_whole_layers_and_serve_a_method_reading_some_heads(model, docs, tmp_path):
    """Pinned host copies are one array per layer: RedKnot (local heads only) gets exactly the tokens of a
    copy kept per head (numpy), and the bytes counted as moved are every head of each layer it touched."""
    cfg = model.config
    row = tuple(HeadClass("global") if h == 0 else HeadClass.local(4, 8) for h in range(cfg.num_kv_heads))
    path = tmp_path / "reuse_heads.json"
    HeadClassMap(cfg.num_layers, cfg.num_kv_heads, tuple(row for _ in range(cfg.num_layers))).save(path)
    got = {}
    for pinned in (False, True):
        eng = engine(model, 2000, segment_head_classes=str(path))
        eng.reuser.tiers.memory_kinds = pinned
        ids = [eng.register_segment(d) for d in docs[:2]]
        eng.reuser.tiers.evict(eng.allocator.num_pages)
        assert isinstance(eng.reuser.tiers._host[ids[0]].k, list) == pinned
        got[pinned] = ask(eng, ids, "redknot"), eng.reuser.tiers.bytes_promoted
    assert got[True][0] == got[False][0]
    per_head = got[False][1]  # the local heads only
    assert got[True][1] == per_head * cfg.num_kv_heads // (cfg.num_kv_heads - 1)


@pytest.fixture(scope="module")
def model5(tmp_path_factory):
    """Five layers: five layer groups of one layer (SparseX: four, its first holding the selection layer)."""
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-5"), num_hidden_layers=5))


def poison_free_pages(eng):
    """Free pages get K/V far from any real one and position 0: a pass that read a promoted page before
    its K/V were written would attend to them."""
    import dataclasses

    alloc = eng.allocator
    free = alloc._free[:alloc.num_free]
    pool = eng.runner.pool
    eng.runner.pool = dataclasses.replace(pool, k=pool.k.at[free].set(40.0), v=pool.v.at[free].set(-60.0),
                                          pos=pool.pos.at[free].set(0))


# Methods that keep most reused K/V in this small prompt (SparseX's default blocks would recompute every
# token of it, RedKnot's edge-mass restore every local head of these random weights), and the programs
# their pass compiles in five layer groups: the first, one shared by the middle groups (their layer offset
# is data), the last (RedKnot too: its dense-FFN layers are data in its one layer body, no `layer_breaks`).
KEEPING = {"naive": "naive", "sparsex": dict(block=4, ratio=0.25), "redknot": dict(edge_thresh=1.0)}
GROUP_PROGRAMS = {"naive": 3, "sparsex": 3, "redknot": 3}


@pytest.mark.parametrize("method", list(KEEPING))
@pytest.mark.parametrize("pinned", [False, True])
def test_a_pass_in_layer_groups_gives_the_single_programs_tokens_and_pool(model5, method, pinned):
    """Segments promoted from host memory: the pass runs as one program per layer group, each group's
    promoted pages written just before its layers; tokens and every pool page equal the single program's.
    Free pages are poisoned first, so a group whose layers ran before its pages were written would differ."""
    rng = np.random.default_rng(5)
    docs = [rng.integers(3, model5.config.vocab_size, SEG).tolist() for _ in range(2)]
    L, H = model5.config.num_layers, model5.config.num_kv_heads
    # RedKnot reads (so promotes) the local heads: head 0 global, the others sink 2 + window 4
    hc = HeadClassMap(L, H, tuple(tuple(HeadClass.global_() if h == 0 else HeadClass.local(2, 4)
                                        for h in range(H)) for _ in range(L)))
    policy = get_reuse_policy(method, **KEEPING[method]) if method != "naive" else method
    got = {}
    for groups in (1, 5):
        eng = engine(model5, 600, segment_head_classes=hc, segment_as_steps=False)  # naive's pass
        eng.reuser.layer_groups = groups
        eng.reuser.tiers.memory_kinds = pinned
        ids = [eng.register_segment(d) for d in docs]
        eng.reuser.tiers.evict(eng.allocator.num_pages)
        assert all(where(eng, s) == ["host"] for s in ids)
        poison_free_pages(eng)
        jax.clear_caches()
        t0 = time.perf_counter()
        rid = eng.add_reuse_request(PREFIX, ids, SUFFIX, reuse=policy, sampling=GREEDY)
        tokens, first_token_s = [], None
        while eng.has_unfinished():
            tokens += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
            if tokens and first_token_s is None:
                first_token_s = time.perf_counter() - t0
        assert reuse_prefill._cache_size() == (1 if groups == 1 else GROUP_PROGRAMS[method])
        # the host's time from admission to the pass's first program is measured within the first step
        assert 0 < eng.reuser.stats[rid].host_before_program_s < first_token_s
        pool = eng.runner.pool
        got[groups] = (tokens, eng.reuser.stats[rid], np.asarray(pool.k), np.asarray(pool.v),
                       np.asarray(pool.pos))
        # the segments are on the device now: the next request runs the single program
        ask(eng, ids, policy)
        assert list(eng.reuser.stats.values())[-1].layer_groups == 1
    (tokens, stats, *pool), (tokens3, stats3, *pool3) = got[1], got[5]
    assert len(tokens) == GREEDY.max_tokens and tokens3 == tokens
    assert (stats.layer_groups, stats3.layer_groups) == (1, 4 if method == "sparsex" else 5)
    assert stats3.kv_writes == stats.kv_writes and stats3.ffn_rows == stats.ffn_rows
    # most reused K/V are kept, not recomputed: the pass reads the promoted pages
    assert stats.recompute_fraction < 0.75
    # K/V equal to float rounding (a middle group's body, its layer offset data, may fuse otherwise than the
    # single program's); a page read before it was written would carry the poison (40 / -60)
    for a, b in zip(pool[:2], pool3[:2]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(pool[2], pool3[2])


@pytest.mark.parametrize("block", [1, 2, 4])
def test_pinned_blocks_moved_ahead_of_each_group_give_the_single_programs_tokens_and_pool(model5, monkeypatch,
                                                                                           block):
    """Host copies in pinned blocks of `block` layers (blocks of 2 and 4 straddle one-layer groups: each moves
    once, with its first group), each group's transfer dispatched one program ahead: tokens and every pool
    page equal the single program's with every transfer first."""
    from jaxkv.engine import segment_tiers

    monkeypatch.setattr(segment_tiers, "HOST_BLOCK_LAYERS", block)
    rng = np.random.default_rng(9)
    docs = [rng.integers(3, model5.config.vocab_size, SEG).tolist() for _ in range(2)]
    L = model5.config.num_layers
    got = []
    for groups, ahead in ((1, None), (5, 1)):
        eng = engine(model5, 600, segment_as_steps=False)  # naive's pass, in groups
        eng.reuser.layer_groups, eng.reuser.promote_ahead = groups, ahead
        eng.reuser.tiers.memory_kinds = True
        ids = [eng.register_segment(d) for d in docs]
        eng.reuser.tiers.evict(eng.allocator.num_pages)
        copy = eng.reuser.tiers._host[ids[0]]
        assert len(copy.k) == -(-L // block) and copy.k[0].shape[0] == block * model5.config.num_kv_heads
        poison_free_pages(eng)
        puts, put = [], jax.device_put

        def spy(x, *a, put=put, puts=puts, **kw):
            puts.append(x)
            return put(x, *a, **kw)

        monkeypatch.setattr(jax, "device_put", spy)
        tokens = ask(eng, ids)
        monkeypatch.setattr(jax, "device_put", put)
        pinned = [y for x in puts for y in jax.tree_util.tree_leaves(x)
                  if isinstance(y, jax.Array) and y.sharding.memory_kind == "pinned_host"]
        assert len(pinned) == len({id(y) for y in pinned}) == 2 * 3 * len(copy.k)  # each block moved once
        assert list(eng.reuser.stats.values())[-1].layer_groups == groups
        pool = eng.runner.pool
        got.append((tokens, np.asarray(pool.k), np.asarray(pool.v), np.asarray(pool.pos)))
    for a, b in zip(got[0], got[1]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_layer_groups_cover_every_layer_and_the_first_holds_the_selection_layer():
    from jaxkv.policies.reuse.apply import layer_groups

    naive, sparsex = get_reuse_policy("naive"), get_reuse_policy("sparsex", full_layers=6)
    assert layer_groups(naive, 32, 8) == [(i, i + 4) for i in range(0, 32, 4)]
    # SparseX scores layer 6's reused K/V: the first group runs layers 0..6, the boundary at 4 goes
    assert layer_groups(sparsex, 32, 8) == [(0, 8)] + [(i, i + 4) for i in range(8, 32, 4)]
    assert layer_groups(naive, 30, 8) == [(0, 4), (4, 8), (8, 11), (11, 15), (15, 19), (19, 22), (22, 26),
                                          (26, 30)]
    assert layer_groups(naive, 3, 8) == [(0, 1), (1, 2), (2, 3)]  # at most one group per layer
    assert layer_groups(get_reuse_policy("sparsex", full_layers=2), 3, 8) == [(0, 3)]  # layer 2 selects
    assert layer_groups(get_reuse_policy("sparsex", full_layers=9), 4, 8) == [(0, 4)]  # every layer dense
    assert layer_groups(naive, 32, 1) == [(0, 32)]


def test_the_first_groups_copy_leaves_at_admission_and_one_pageable_transfer_waits_behind_it(model5,
                                                                                             monkeypatch):
    """A transfer of pageable numpy is synchronous: queued behind the asynchronous transfers of pinned
    host copies it holds the host until they have moved, and no program of the pass goes out meanwhile.
    The first group's K/V leave before the host lays the prompt out (their copy runs meanwhile); then the
    pass's inputs go in one pageable transfer, which waits at most for what is left of that copy; nothing
    else pageable goes out before the first program."""
    import jaxkv.engine.reuse as reuse_mod
    import jaxkv.engine.segment_tiers as tiers_mod

    rng = np.random.default_rng(7)
    docs = [rng.integers(3, model5.config.vocab_size, SEG).tolist() for _ in range(2)]
    eng = engine(model5, 600, segment_as_steps=False)  # naive's pass, in groups
    eng.reuser.layer_groups = 5
    eng.reuser.tiers.memory_kinds = True
    ids = [eng.register_segment(d) for d in docs]
    eng.reuser.tiers.evict(eng.allocator.num_pages)
    assert all(where(eng, s) == ["host"] for s in ids)
    events = []  # ("put", pinned arrays, numpy arrays) per transfer call, ("program",) per program
    put = jax.device_put

    def spy_put(x, *a, **kw):
        leaves = jax.tree_util.tree_leaves(x)
        pinned = sum(isinstance(y, jax.Array) and y.sharding.memory_kind == "pinned_host" for y in leaves)
        events.append(("put", pinned, sum(isinstance(y, np.ndarray | np.generic) for y in leaves)))
        return put(x, *a, **kw)

    def program(fn):
        def run(*a, **kw):
            events.append(("program",))
            return fn(*a, **kw)
        return run

    monkeypatch.setattr(jax, "device_put", spy_put)
    monkeypatch.setattr(tiers_mod, "_write_pages", program(tiers_mod._write_pages))
    monkeypatch.setattr(reuse_mod, "reuse_prefill", program(reuse_mod.reuse_prefill))
    tokens = ask(eng, ids)
    assert eng.reuser.stats and list(eng.reuser.stats.values())[-1].layer_groups == 5
    first_pinned = next(i for i, e in enumerate(events) if e[0] == "put" and e[1])
    first_program = events.index(("program",))
    assert first_pinned < first_program
    pageable = [i for i, e in enumerate(events[first_pinned:first_program]) if e[0] == "put" and e[2]]
    assert len(pageable) == 1  # the pass's inputs, laid out while the first group's K/V moved
    monkeypatch.undo()
    # the same tokens with the segments already on the device (one program, nothing moved)
    assert ask(eng, ids) == tokens


@pytest.mark.parametrize("groups", [1, 5])
def test_a_store_promotion_moves_layers_as_they_are_read_and_refuses_a_damaged_read(model5, tmp_path,
                                                                                     monkeypatch, groups):
    """From the store, a promotion sends each piece of layers to the device once it is read and checked (one
    layer per piece here: the first is sent while the last is still unread) and answers as from the device.
    A chunk damaged in the last layer fails its checksum: the request is refused, that segment's new pages go
    back (it names none, so nothing of it is ever served) and stays in the store; the other segment is
    promoted, and the next request reads the repaired chunk. In layer groups this happens before the pass."""
    import threading

    from jaxkv.cache.segment_store import SegmentRead, SegmentStore
    from jaxkv.engine import segment_tiers

    monkeypatch.setattr(segment_tiers, "STORE_PIECE_LAYERS", 1)
    rng = np.random.default_rng(7)
    docs = [rng.integers(3, model5.config.vocab_size, SEG).tolist() for _ in range(2)]
    L = model5.config.num_layers
    eng = engine(model5, 600, segment_store=str(tmp_path), segment_host_bytes=0)
    eng.reuser.layer_groups = groups
    ids = [eng.register_segment(d) for d in docs]
    want = ask(eng, ids)
    tiers, store = eng.reuser.tiers, eng.reuser.store

    # pipelined: the last layer of the first segment is read only once the first layer was handed over
    first_sent, real_read, real_wait = threading.Event(), SegmentStore._read_layer, SegmentRead.wait

    def wait(self, l0=0, l1=None):
        real_wait(self, l0, l1)
        if (l0, l1) == (0, 1):
            first_sent.set()

    def read_layer(self, segment_id, layer, *args):
        if layer == L - 1 and groups == 1:
            assert first_sent.wait(20), "the promotion waited for the whole read before moving a layer"
        return real_read(self, segment_id, layer, *args)

    monkeypatch.setattr(SegmentRead, "wait", wait)
    monkeypatch.setattr(SegmentStore, "_read_layer", read_layer)
    for s in ids:
        tiers.place(store.get(s), "store")
    assert ask(eng, ids) == want and (groups > 1 or first_sent.is_set())

    for s in ids:
        tiers.place(store.get(s), "store")
    chunk = tmp_path / "segments" / ids[0] / "k" / "c" / str(L - 1) / "1" / "0" / "0"
    data = chunk.read_bytes()
    chunk.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    free, promoted = eng.allocator.num_free, tiers.bytes_promoted
    rid = eng.add_reuse_request(PREFIX, ids, SUFFIX, reuse="naive", sampling=GREEDY)
    outs = [o for _ in range(5) for o in eng.step() if o.request_id == rid]
    assert outs and outs[-1].finish_reason == "abort" and "checksum" in outs[-1].text
    assert not any(o.new_token_ids for o in outs)
    bad, good = store.get(ids[0]), store.get(ids[1])
    assert (bad.pages == -1).all() and tiers.tiers(bad) == ["store"]
    assert tiers.device_heads(good).all() and free - eng.allocator.num_free == good.pages.size
    assert tiers.bytes_promoted - promoted == tiers.L * tiers.H * tiers.head_bytes(good)  # the good one only
    chunk.write_bytes(data)  # repaired: read again on the next use
    assert ask(eng, ids) == want
