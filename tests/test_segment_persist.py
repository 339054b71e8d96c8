"""Segments that survive the engine: registered into an engine with a segment store, they come back in a
new engine on the same store without any prefill, and reuse gives the same tokens; another layout is
refused; a deleted segment stays deleted."""

import numpy as np
import pytest

pytest.importorskip("tensorstore")

import jaxkv  # noqa: E402
from jaxkv.cache.head_classes import all_global  # noqa: E402
from jaxkv.cache.segment_store import StoreMismatchError  # noqa: E402
from jaxkv.engine.engine import Engine  # noqa: E402
from jaxkv.engine.reuse import Reuser  # noqa: E402
from jaxkv.sampling import SamplingParams  # noqa: E402
from tests.hf_tiny import make_tiny_checkpoint  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-persist")))


def engine(model, store, page_size=4):
    cfg = model.config
    return Engine(model, page_size=page_size, max_model_len=128, attn_impl="reference",
                  head_classes=all_global(cfg.num_layers, cfg.num_kv_heads), segment_store=str(store))


def reuse_tokens(eng, segments, method="naive"):
    rid = eng.add_reuse_request([5, 6, 7], segments, [9, 10, 11], reuse=method, sampling=GREEDY)
    out = []
    while eng.has_unfinished():
        out += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    return out


def test_segments_survive_a_new_engine_without_prefill(model, tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    doc, other = (rng.integers(3, model.config.vocab_size, n).tolist() for n in (19, 9))
    a = engine(model, tmp_path)
    sid = a.register_segment(doc, frozen=True)
    gone = a.register_segment(other)
    a.delete_segment(gone)
    want = reuse_tokens(a, [sid])
    assert a.reuser.persist.bytes_written > 0

    def no_prefill(*args, **kw):
        raise AssertionError("a restored segment was prefilled again")

    monkeypatch.setattr(Reuser, "_prefill_segment", no_prefill)
    b = engine(model, tmp_path)  # a restart: a new engine on the same store
    assert b.segments_restored == 1 and sid in b.reuser.store and gone not in b.reuser.store
    entry = b.reuser.store.get(sid)
    assert entry.frozen and entry.tokens == tuple(doc)
    ids = entry.pages.reshape(-1)
    old = a.reuser.store.get(sid).pages.reshape(-1)
    np.testing.assert_array_equal(np.asarray(b.runner.pool.k[ids]), np.asarray(a.runner.pool.k[old]))
    assert reuse_tokens(b, [sid]) == want
    assert b.register_segment(doc, frozen=True) == sid  # found, not prefilled


def test_another_layout_is_refused(model, tmp_path):
    engine(model, tmp_path).register_segment(list(range(3, 20)))
    with pytest.raises(StoreMismatchError, match="page_size"):
        engine(model, tmp_path, page_size=8)


def test_a_delete_on_one_server_reaches_another_sharing_the_store(model, tmp_path, monkeypatch):
    """Two engines on one store: a segment one deletes is refused by the other on its next use (it checks the
    store's commit at most every CONFIRM_EVERY_S), its pages freed; one deleted nowhere keeps serving."""
    from jaxkv.cache.segments import SegmentError
    from jaxkv.engine import segment_persist

    rng = np.random.default_rng(1)
    doc, kept = (rng.integers(3, model.config.vocab_size, n).tolist() for n in (13, 11))
    a = engine(model, tmp_path)
    sid, other = a.register_segment(doc), a.register_segment(kept)
    b = engine(model, tmp_path)
    assert sid in b.reuser.store and reuse_tokens(b, [sid]) == reuse_tokens(a, [sid])
    free = b.allocator.num_free
    a.delete_segment(sid)
    monkeypatch.setattr(segment_persist, "CONFIRM_EVERY_S", 0.0)
    with pytest.raises(SegmentError, match="was deleted"):
        b.add_reuse_request([5, 6, 7], [sid], [9, 10, 11], reuse="naive", sampling=GREEDY)
    assert sid not in b.reuser.store and b.allocator.num_free > free  # its pages came back
    assert reuse_tokens(b, [other]) == reuse_tokens(a, [other])
