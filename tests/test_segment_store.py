"""The tensorstore segment store: round trips per head, identity checks, checksums, and a writer killed
with SIGKILL at random points never leaves a segment that is half there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("tensorstore")

from jaxkv.cache.segment_store import (  # noqa: E402
    CorruptSegmentError,
    SegmentStore,
    StoredSegment,
    StoreMismatchError,
)
from jaxkv.cache.segments import segment_id  # noqa: E402

IDENTITY = {"model_id": "tiny-0123", "kv_dtype": "bfloat16", "page_size": 16, "num_layers": 2,
            "num_kv_heads": 3, "head_dim": 8}
L, H, S, D = 2, 3, 32, 8


def make_segment(seed: int, sid: str | None = None, heads=None, extra_key=None) -> StoredSegment:
    rng = np.random.default_rng(seed)
    tokens = tuple(int(t) for t in rng.integers(0, 500, 20))
    k = rng.normal(size=(L, H, S, D)).astype(ml_dtypes.bfloat16)
    v = rng.normal(size=(L, H, S, D)).astype(ml_dtypes.bfloat16)
    pos = np.where(np.arange(S) < 20, np.arange(S) + 1, -1).astype(np.int32)
    heads = np.ones((L, H), bool) if heads is None else heads
    sid = sid or segment_id(IDENTITY["model_id"], tokens, extra_key)
    return StoredSegment(sid, tokens, extra_key, k, v, np.broadcast_to(pos, (L, H, S)).copy(), heads,
                         frozen=True, start=1)


def same(a, b):
    return np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_round_trip_and_a_second_process_view(tmp_path):
    store = SegmentStore(tmp_path, IDENTITY)
    seg = make_segment(0)
    store.put(seg)
    again = SegmentStore(tmp_path, IDENTITY)  # what a restarted (or second) server sees
    got = again.get(seg.segment_id)
    assert same(got.k, seg.k) and same(got.v, seg.v) and np.array_equal(got.pos, seg.pos)
    assert got.tokens == seg.tokens and got.frozen and got.start == 1 and got.extra_key is None
    assert [m["segment_id"] for m in again.list()] == [seg.segment_id]
    again.delete(seg.segment_id)
    assert store.list() == [] and store.meta(seg.segment_id) is None
    with pytest.raises(KeyError):
        store.get(seg.segment_id)


def test_only_the_chosen_heads_are_written_and_read(tmp_path):
    store = SegmentStore(tmp_path, IDENTITY)
    full = store.put(make_segment(1))
    heads = np.zeros((L, H), bool)
    heads[:, 0] = True  # e.g. the local heads a method reads from the store
    seg = make_segment(2, heads=heads)
    part = store.put(seg)
    assert part * H == full  # bytes scale with the heads kept
    got = store.get(seg.segment_id)
    assert same(got.k[:, 0], seg.k[:, 0]) and (got.pos[:, 1:] == -1).all() and not got.k[:, 1:].any()
    one = store.get(seg.segment_id, heads=np.eye(L, H, dtype=bool))
    assert one.heads.tolist() == [[True, False, False], [False, False, False]]


def test_namespaces_stay_apart(tmp_path):
    store = SegmentStore(tmp_path, IDENTITY)
    a, b = make_segment(3, extra_key="tenant-a"), make_segment(3, extra_key="tenant-b")
    assert a.tokens == b.tokens and a.segment_id != b.segment_id
    store.put(a)
    assert store.meta(b.segment_id) is None
    store.put(b)
    assert store.get(a.segment_id).extra_key == "tenant-a" and store.get(b.segment_id).extra_key == "tenant-b"


def test_another_model_or_layout_is_refused(tmp_path):
    SegmentStore(tmp_path, IDENTITY)
    for change in ({"model_id": "other-model"}, {"page_size": 32}, {"kv_dtype": "float32"}):
        with pytest.raises(StoreMismatchError, match="another model or KV layout"):
            SegmentStore(tmp_path, {**IDENTITY, **change})


def _chunk_files(root: Path, sid: str) -> list[Path]:
    files = (root / "segments" / sid / "k").rglob("*")
    return sorted(p for p in files if p.is_file() and p.name != "zarr.json")


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_damaged_entry_is_reported_not_served(tmp_path, damage):
    store = SegmentStore(tmp_path, IDENTITY)
    seg = make_segment(4)
    store.put(seg)
    chunk = _chunk_files(tmp_path, seg.segment_id)[0]
    data = bytearray(chunk.read_bytes())
    if damage == "flip":
        data[-1] ^= 0xFF
        chunk.write_bytes(bytes(data))
    elif damage == "truncate":
        chunk.write_bytes(bytes(data[: len(data) // 2]))
    else:
        chunk.unlink()
    with pytest.raises(CorruptSegmentError, match=seg.segment_id):
        store.get(seg.segment_id)


WRITER = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_segment_store import IDENTITY, make_segment
from jaxkv.cache.segment_store import SegmentStore
store = SegmentStore({root!r}, IDENTITY)
i = {first}
while True:
    store.put(make_segment(i, sid=f"seg-{{i:05d}}"))
    print(i, flush=True)
    i += 1
"""


def test_kill_9_mid_write_leaves_each_segment_whole_or_absent(tmp_path):
    rng = np.random.default_rng(0)
    committed: set[int] = set()
    first = 0
    for _ in range(6):
        code = WRITER.format(tests=str(Path(__file__).parent), root=str(tmp_path), first=first)
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
        line = p.stdout.readline()  # the writer is up and has committed one segment
        assert line.strip(), "writer did not start"
        time.sleep(float(rng.uniform(0.0, 0.3)))
        p.send_signal(signal.SIGKILL)
        out, _ = p.communicate()
        committed |= {int(x) for x in (line + out).split()}
        first = max(committed) + 2  # the id being written when killed may or may not have committed
    store = SegmentStore(tmp_path, IDENTITY)
    listed = {m["segment_id"] for m in store.list()}
    assert {f"seg-{i:05d}" for i in committed} <= listed  # every acknowledged write survived
    for sid in listed:  # and everything listed reads back whole, checksum and all
        got = store.get(sid)
        want = make_segment(int(sid.split("-")[1]), sid=sid)
        assert same(got.k, want.k) and same(got.v, want.v)
    store.sweep(older_than_s=0)
    with_data = {p.name for p in (tmp_path / "segments").iterdir() if any(f.is_file() for f in p.rglob("*"))}
    assert with_data == listed  # leftovers of killed writes are gone


def not_decoded_by_tensorstore(*args):
    raise AssertionError("plain chunks are read into place, not decoded through tensorstore")


def test_a_read_hands_over_layer_by_layer_and_checks_each(tmp_path):
    """`read` returns at once and fills layer by layer: layer 0 can be waited for (and used) while a later
    layer is still unread; a damaged chunk fails only the wait that covers its layer."""
    import threading

    store = SegmentStore(tmp_path, IDENTITY)
    store._read_with_tensorstore = not_decoded_by_tensorstore
    seg = make_segment(5)
    store.put(seg)
    gate = threading.Event()
    real = store._read_layer

    def held_back(segment_id, layer, *args):
        if layer == L - 1:
            assert gate.wait(20), "the last layer was waited for before the first was handed over"
        return real(segment_id, layer, *args)

    store._read_layer = held_back
    read = store.read(seg.segment_id)
    read.wait(0, 1)  # while the last layer is still held back
    assert same(read.k[0], seg.k[0]) and same(read.v[0], seg.v[0]) and not read.done()
    gate.set()
    got = read.result()
    assert same(got.k, seg.k) and same(got.v, seg.v) and np.array_equal(got.pos, seg.pos)
    del store._read_layer

    chunk = tmp_path / "segments" / seg.segment_id / "v" / "c" / str(L - 1) / "2" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0x01
    chunk.write_bytes(bytes(data))
    read = store.read(seg.segment_id)
    read.wait(0, L - 1)  # the layers before it are whole
    with pytest.raises(CorruptSegmentError, match="checksum"):
        read.wait(L - 1, L)
    assert read.failed()


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_store_read_through_the_kvstore_reads_and_checks_the_same(tmp_path, damage):
    """Where the store is not a local directory (gs://, s3://, ...), chunks are read through the tensorstore
    kvstore into place (here the local directory's kvstore, its file reads turned off), with the same
    checks."""
    store = SegmentStore(tmp_path, IDENTITY)
    store._local_root = lambda: None
    store._read_with_tensorstore = not_decoded_by_tensorstore
    seg = make_segment(6)
    store.put(seg)
    got = store.get(seg.segment_id)
    assert same(got.k, seg.k) and same(got.v, seg.v) and np.array_equal(got.pos, seg.pos)
    chunk = tmp_path / "segments" / seg.segment_id / "k" / "c" / "1" / "0" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    if damage == "flip":
        data[3] ^= 0x10
        chunk.write_bytes(bytes(data))
    elif damage == "truncate":
        chunk.write_bytes(bytes(data[:-2]))
    else:
        chunk.unlink()
    with pytest.raises(CorruptSegmentError, match=seg.segment_id):
        store.get(seg.segment_id)
