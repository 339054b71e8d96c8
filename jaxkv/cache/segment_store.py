"""Persistent segment KV on tensorstore: per-(layer, KV head) arrays that outlive the process and the GPU.

A store is a tensorstore key-value store (a local directory by default; any tensorstore kvstore URL such as
``gs://bucket/prefix/`` or ``s3://...`` for a fleet of servers sharing one store) laid out as::

    store.json                      identity: model id, KV dtype, page size, layers, KV heads, head dim
    segments/<id>/k, v              zarr3 arrays [L, Hkv, slots, D], one chunk per (layer, KV head)
    segments/<id>/pos               zarr3 array  [L, Hkv, slots] int32 (original positions, -1 = empty)
    segments/<id>/meta.json         tokens, namespace, context, frozen, start, stored heads, checksums

**Per-head placement.** Only the (layer, KV head) pairs a method will read are written (`heads` mask);
the others have no chunks at all, so bytes on disk and bytes moved scale with the heads kept. A read may
ask for some heads only (`get(heads=...)`): each chunk has its own checksum, so only those are read.

**Crash safety.** `meta.json` is written last and is the commit: a segment whose meta is missing was never
committed and is invisible (`list` skips it, `sweep` removes its leftovers). The meta holds a blake2b
checksum of every stored chunk's bytes, checked on `get`: a corrupted or truncated entry raises
`CorruptSegmentError` and is never served.

**Reads.** `read` hands a segment over layer by layer while later layers are still read (chunk files read
straight into place, each checked right after its read); `get` waits for all of it.

**Identity.** A store opened with another model's identity (weights, dtype, page layout) is refused with
`StoreMismatchError`, never silently reused. Namespaces stay apart because they are part of the segment id
(`jaxkv.cache.segments.segment_id`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "jaxkv.segment_store/v1"


class StoreMismatchError(ValueError):
    """The store was written for another model or KV layout."""


class CorruptSegmentError(ValueError):
    """A stored segment failed its checksum or could not be read."""


@dataclasses.dataclass
class StoredSegment:
    """One segment's KV as host arrays. `heads[l, h]` says which (layer, KV head) pairs carry data; the
    others read back as zeros with position -1."""

    segment_id: str
    tokens: tuple[int, ...]
    extra_key: str | None
    k: np.ndarray  # [L, Hkv, slots, D]
    v: np.ndarray  # [L, Hkv, slots, D]
    pos: np.ndarray  # [L, Hkv, slots] int32
    heads: np.ndarray  # [L, Hkv] bool
    context: tuple[int, ...] = ()
    frozen: bool = False
    start: int = 0
    extra: dict = dataclasses.field(default_factory=dict)  # method metadata (JSON-serialisable)


class SegmentRead:
    """A store read under way (`SegmentStore.read`): `k`, `v` [L, Hkv, slots, D] and `pos` [L, Hkv, slots]
    fill layer by layer; `wait(l0, l1)` returns once layers [l0, l1) are read and checked (raising
    CorruptSegmentError when they are not whole), so those layers can move on while later ones are read."""

    def __init__(self, store: SegmentStore, segment_id: str, meta: dict, heads: np.ndarray, out: dict):
        self.store, self.segment_id, self.meta, self.heads = store, segment_id, meta, heads
        self.k, self.v, self.pos = out["k"], out["v"], out["pos"]
        self._futures: list[Future] = []
        self.started = time.perf_counter()
        self.finished: float | None = None  # perf_counter when its last layer was read and checked

    def wait(self, l0: int = 0, l1: int | None = None) -> None:
        for f in self._futures[l0:l1]:
            try:
                f.result()
            except CancelledError:
                raise CorruptSegmentError(f"the read of segment {self.segment_id} was cancelled") from None

    def _layer_done(self, _f: Future) -> None:
        self.finished = time.perf_counter()

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def failed(self) -> bool:
        """Finished with an error (a read still running is not known to have failed)."""
        return any(f.done() and (f.cancelled() or f.exception() is not None) for f in self._futures)

    def cancel(self) -> None:
        """Drops the layers not started yet (the read is then never waited on)."""
        for f in self._futures:
            f.cancel()

    def result(self) -> StoredSegment:
        self.wait()
        m = self.meta
        return StoredSegment(self.segment_id, tuple(m["tokens"]), m["extra_key"], self.k, self.v, self.pos,
                             self.heads, tuple(m["context"]), m["frozen"], m["start"], m.get("extra", {}))


def _kvstore(url: str | Path) -> dict:
    """A tensorstore kvstore spec from a local path or a URL (``file://``, ``gs://``, ``s3://``, ...)."""
    text = str(url)
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        return text  # tensorstore parses gs://, s3://, ... itself
    return {"driver": "file", "path": str(Path(text).resolve()) + "/"}


class SegmentStore:
    """Segments of one model in a tensorstore store (module docstring)."""

    def __init__(self, url: str | Path, identity: dict[str, Any]):
        import tensorstore as ts

        self._ts = ts
        self.url = str(url)
        self.identity = {"format": FORMAT, **{k: identity[k] for k in sorted(identity)}}
        self._kv = ts.KvStore.open(_kvstore(url)).result()
        found = self._read_json("store.json")
        if found is None:
            self._write_json("store.json", self.identity)
        elif found != self.identity:
            diff = {k: (found.get(k), self.identity.get(k)) for k in set(found) | set(self.identity)
                    if found.get(k) != self.identity.get(k)}
            raise StoreMismatchError(f"segment store {self.url} was written for another model or KV layout "
                                     f"(stored vs this server: {diff}); use another --segment-store")

    # ---- key-value helpers --------------------------------------------------------------------
    def _read_json(self, key: str) -> dict | None:
        r = self._kv.read(key).result()
        if r.state != "value":
            return None
        try:
            return json.loads(bytes(r.value))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorruptSegmentError(f"{self.url}/{key}: not valid JSON ({e})") from e

    def _write_json(self, key: str, data: dict) -> None:
        self._kv.write(key, json.dumps(data, sort_keys=True).encode()).result()

    def _array(self, seg: str, name: str, shape=None, dtype=None, create=False):
        kvstore = {**_kvstore_base(self._kv), "path": (self._kv.path or "") + f"segments/{seg}/{name}/"}
        spec = {"driver": "zarr3", "kvstore": kvstore}
        if create:
            chunk = [1, 1, *shape[2:]]
            spec["metadata"] = {"shape": list(shape), "data_type": _zarr_dtype(dtype),
                                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
                                "fill_value": -1 if name == "pos" else 0}
            return self._ts.open(spec, create=True, delete_existing=True).result()
        return self._ts.open(spec, open=True).result()

    # ---- public API ---------------------------------------------------------------------------
    def put(self, seg: StoredSegment) -> int:
        """Writes a segment (only its `heads`), committing it with its meta last; returns the bytes of K/V
        and positions written."""
        L, H = seg.heads.shape
        arrays = {"k": seg.k, "v": seg.v, "pos": seg.pos.astype(np.int32)}
        self.delete(seg.segment_id)  # a rewrite starts uncommitted
        heads = [(layer, head) for layer in range(L) for head in range(H) if seg.heads[layer, head]]
        written = 0
        chunks = {name: [[None] * H for _ in range(L)] for name in arrays}
        for name, data in arrays.items():
            arr = self._array(seg.segment_id, name, data.shape, data.dtype, create=True)
            if len(heads) == L * H:  # every head: one write, tensorstore writes the chunks concurrently
                data = np.ascontiguousarray(data)
                futures = [arr.write(data)]
            else:
                futures = [arr[layer, head].write(np.ascontiguousarray(data[layer, head]))
                           for layer, head in heads]
            for (layer, head), d in zip(heads, _digests([data[layer, head] for layer, head in heads])):
                chunks[name][layer][head] = d
            written += sum(data[layer, head].nbytes for layer, head in heads)
            for f in futures:
                f.result()
        meta = {"segment_id": seg.segment_id, "tokens": list(seg.tokens), "extra_key": seg.extra_key,
                "context": list(seg.context), "frozen": bool(seg.frozen), "start": int(seg.start),
                "heads": seg.heads.astype(int).tolist(), "shape": list(seg.k.shape),
                "dtype": np.dtype(seg.k.dtype).name, "bytes": written,
                "chunk_checksums": chunks,
                "extra": seg.extra}
        self._write_json(f"segments/{seg.segment_id}/meta.json", meta)  # the commit
        return written

    def meta(self, segment_id: str) -> dict | None:
        """A committed segment's metadata, or None."""
        return self._read_json(f"segments/{segment_id}/meta.json")

    def committed(self, segment_id: str) -> bool:
        """Whether the segment's commit is in the store (a listing of one key: its metadata is not read)."""
        key = f"segments/{segment_id}/meta.json"
        return bool(self._kv.list(self._ts.KvStore.KeyRange(key, key + "\0")).result())

    def list(self) -> list[dict]:
        """Metadata of every committed segment (uncommitted leftovers are skipped)."""
        out = []
        for seg in self._segment_dirs():
            m = self.meta(seg)
            if m is not None:
                out.append(m)
        return out

    def get(self, segment_id: str, heads: np.ndarray | None = None) -> StoredSegment:
        """Reads a committed segment (only `heads` if given, a subset of the stored ones) and checks its
        checksums (CorruptSegmentError on mismatch or unreadable data): each chunk read against its own,
        so a read of some heads reads only theirs (stores written before per-chunk checksums: every
        stored head is read and checked against the whole-segment checksum)."""
        return self.read(segment_id, heads).result()

    def read(self, segment_id: str, heads: np.ndarray | None = None) -> SegmentRead:
        """Starts reading a committed segment (`get`'s heads and checks) and returns at once: the
        `SegmentRead` fills layer by layer on reader threads, so a caller can move the first layers on while
        later ones are still read. KeyError now when the segment is not committed.

        Chunks stored as plain little-endian bytes (how `put` writes them) are read straight into the
        returned arrays, one task per layer, each chunk hashed right after its read while its bytes are still
        in the CPU's cache; other encodings and stores written before per-chunk checksums go through
        tensorstore."""
        m = self.meta(segment_id)
        if m is None:
            raise KeyError(segment_id)
        stored = np.asarray(m["heads"], bool)
        want = stored if heads is None else (np.asarray(heads, bool) & stored)
        L, H, slots, D = m["shape"]
        dtype = _np_dtype(m["dtype"])
        out = {"k": np.zeros((L, H, slots, D), dtype), "v": np.zeros((L, H, slots, D), dtype),
               "pos": np.full((L, H, slots), -1, np.int32)}
        read = SegmentRead(self, segment_id, m, want, out)
        chunks = m.get("chunk_checksums")
        if chunks is None or not self._plain_chunks(segment_id, out):
            read._futures = [_reader_pool().submit(self._read_with_tensorstore, segment_id, m, want, stored,
                                                   out)] * L
            read._futures[0].add_done_callback(read._layer_done)
            return read
        pool, local = _reader_pool(), self._local_root()
        read._futures = [pool.submit(self._read_layer, segment_id, layer, want[layer], out, chunks, local)
                         if want[layer].any() else _done(lambda: None) for layer in range(L)]
        for f in read._futures:
            f.add_done_callback(read._layer_done)
        return read

    def _plain_chunks(self, segment_id: str, out: dict) -> bool:
        """Whether every array of the segment is stored as `put` writes it: one chunk per (layer, KV head),
        raw little-endian bytes of the expected dtype and shape, default chunk keys (so a chunk's bytes can
        be read into place without tensorstore decoding them)."""
        if sys.byteorder != "little":
            return False
        for name, arr in out.items():
            z = self._read_json(f"segments/{segment_id}/{name}/zarr.json")
            if z is None:
                return False
            grid = z.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape")
            codecs = z.get("codecs")
            if (z.get("shape") != list(arr.shape) or grid != [1, 1, *arr.shape[2:]]
                    or z.get("data_type") != _zarr_dtype(arr.dtype)
                    or z.get("chunk_key_encoding", {}).get("name") != "default"
                    or z.get("chunk_key_encoding", {}).get("configuration", {}).get("separator", "/") != "/"
                    or not isinstance(codecs, list) or len(codecs) != 1 or codecs[0].get("name") != "bytes"
                    or codecs[0].get("configuration", {}).get("endian", "little") != "little"):
                return False
        return True

    def _read_layer(self, segment_id: str, layer: int, want: np.ndarray, out: dict, chunks: dict,
                    local: Path | None) -> None:
        """Reads and checks the wanted heads of one layer (k, v, pos chunks) into `out`: from the files of
        a local store (`local`, its root; every file of the layer announced to the kernel first, so the disk
        reads them all while the first ones are hashed), else through the kvstore."""
        todo = [(name, int(head), f"segments/{segment_id}/{name}/c/{layer}/{head}/"
                 + "/".join(["0"] * (out[name].ndim - 2)))
                for name in ("k", "v", "pos") for head in np.nonzero(want)[0]]
        ahead = {key: _open_ahead(local / key) for *_, key in todo} if local is not None else {}
        try:
            for name, head, key in todo:
                block = out[name][layer, head]
                try:
                    if local is not None:
                        _read_file(ahead.pop(key, None), local / key, _bytes(block))
                    else:
                        _read_value(self._kv, key, _bytes(block))
                except (OSError, ValueError) as e:
                    raise CorruptSegmentError(f"segment {segment_id} in {self.url} cannot be read: {key}: "
                                              f"{e}") from e
                if _chunk_digest(block) != chunks[name][layer][head]:
                    raise CorruptSegmentError(f"segment {segment_id} in {self.url} failed its checksum: the "
                                              "stored KV was changed or truncated after it was written")
        finally:
            for fd in ahead.values():
                if fd is not None:
                    os.close(fd)

    def _read_with_tensorstore(self, segment_id: str, m: dict, want, stored, out: dict) -> None:
        """`read` through tensorstore (any chunk encoding; stores written before per-chunk checksums)."""
        L, H = want.shape
        chunks = m.get("chunk_checksums")
        read = want if chunks is not None else stored
        where = [(l_, h) for l_ in range(L) for h in range(H) if read[l_, h]]
        bad, digest = [], hashlib.blake2b(digest_size=16)
        try:
            for name in ("k", "v", "pos"):
                arr = self._array(segment_id, name)
                reads = [arr[l_, h].read() for l_, h in where]
                blocks = [np.asarray(f.result()) for f in reads]
                for (l_, h), block in zip(where, blocks):
                    if want[l_, h]:
                        out[name][l_, h] = block
                if chunks is not None:
                    bad += [(name, l_, h) for (l_, h), d in zip(where, _digests(blocks))
                            if d != chunks[name][l_][h]]
                else:  # a store written before per-chunk checksums: one digest of every stored chunk
                    for block in blocks:
                        digest.update(_bytes(block))
        except Exception as e:  # tensorstore raises ValueError subclasses for missing / undecodable chunks
            raise CorruptSegmentError(f"segment {segment_id} in {self.url} cannot be read: {e}") from e
        if bad or (chunks is None and digest.hexdigest() != m.get("checksum")):
            raise CorruptSegmentError(f"segment {segment_id} in {self.url} failed its checksum: the stored "
                                      "KV was changed or truncated after it was written")

    def delete(self, segment_id: str) -> None:
        """Removes a segment: its commit first (a crash mid-delete leaves it uncommitted), then its data."""
        self._kv.delete_range(self._ts.KvStore.KeyRange(f"segments/{segment_id}/meta.json",
                                                        f"segments/{segment_id}/meta.json\0")).result()
        self._kv.delete_range(self._ts.KvStore.KeyRange(f"segments/{segment_id}/",
                                                        f"segments/{segment_id}0")).result()

    def sweep(self, older_than_s: float = 600.0) -> int:
        """Deletes the leftovers of uncommitted writes (a writer killed mid-write) untouched for
        `older_than_s` seconds, so a write still in progress in another process is left alone; returns how
        many. In a local directory that includes the storage driver's own temporary files; elsewhere, where
        no age is known, only `older_than_s=0` deletes."""
        local = self._local_root()
        now = time.time()
        n = 0
        names = set(self._segment_dirs())
        if local is not None and (local / "segments").is_dir():
            names |= {p.name for p in (local / "segments").iterdir() if p.is_dir()}
        for seg in sorted(names):
            if self.meta(seg) is not None:
                continue
            if local is not None:
                d = local / "segments" / seg
                newest = max((p.stat().st_mtime for p in d.rglob("*")), default=0.0) if d.exists() else 0.0
                if now - newest < older_than_s:
                    continue
                self.delete(seg)
                shutil.rmtree(d, ignore_errors=True)
            elif older_than_s <= 0:
                self.delete(seg)
            else:
                continue
            n += 1
        return n

    def _local_root(self) -> Path | None:
        spec = self._kv.spec().to_json()
        return Path(spec["path"]) if spec.get("driver") == "file" else None

    def _segment_dirs(self) -> list[str]:
        keys = self._kv.list(self._ts.KvStore.KeyRange("segments/", "segments0")).result()
        return sorted({bytes(k).decode().split("/")[1] for k in keys if bytes(k).count(b"/") >= 2})


def _bytes(block: np.ndarray) -> memoryview:
    """The block's bytes without a copy (a bfloat16 array offers no buffer of its own dtype)."""
    return memoryview(np.ascontiguousarray(block).reshape(-1).view(np.uint8))


def _chunk_digest(block: np.ndarray) -> str:
    return hashlib.blake2b(_bytes(block), digest_size=16).hexdigest()


_hashers: ThreadPoolExecutor | None = None
_readers: ThreadPoolExecutor | None = None
READ_THREADS = 16  # layers read at once: queue depth for a disk, every core for hashing from the page cache


def _reader_pool() -> ThreadPoolExecutor:
    global _readers
    if _readers is None:
        _readers = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="jaxkv-segment-read")
    return _readers


def _done(fn, *args) -> Future:
    """`fn(*args)` run now, as a finished future (its exception kept for `result`)."""
    f: Future = Future()
    try:
        f.set_result(fn(*args))
    except Exception as e:
        f.set_exception(e)
    return f


def _open_ahead(path: Path) -> int | None:
    """The chunk file opened and its reading from the disk started (POSIX_FADV_WILLNEED); None when it
    cannot be opened now (`_read_file` opens it again and reports why)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    return fd


def _read_file(fd: int | None, path: Path, into: memoryview) -> None:
    """A chunk file's bytes (from `fd`, which it closes, else opened from `path`) straight into `into`, which
    they must fill exactly (else ValueError)."""
    fd = os.open(path, os.O_RDONLY) if fd is None else fd
    try:
        size = os.fstat(fd).st_size
        if size != len(into):
            raise ValueError(f"{size} bytes, expected {len(into)}")
        done = 0
        while done < size:
            n = os.preadv(fd, [into[done:]], done)
            if n <= 0:
                raise ValueError(f"ended at {done} of {size} bytes")
            done += n
    finally:
        os.close(fd)


def _read_value(kv, key: str, into: memoryview) -> None:
    """A chunk's bytes from any tensorstore kvstore into `into` (one copy)."""
    r = kv.read(key).result()
    if r.state != "value":
        raise ValueError("missing")
    value = memoryview(r.value).cast("B")
    if len(value) != len(into):
        raise ValueError(f"{len(value)} bytes, expected {len(into)}")
    into[:] = value


def _digests(blocks: list[np.ndarray]) -> list[str]:
    """Every block's checksum, on a thread pool: hashlib releases the GIL for large buffers, so a segment's
    chunks hash on every core (one thread: ~1 GB/s, the bottleneck of a store read)."""
    global _hashers
    if len(blocks) < 2:
        return [_chunk_digest(b) for b in blocks]
    if _hashers is None:
        _hashers = ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1),
                                      thread_name_prefix="jaxkv-segment-hash")
    return list(_hashers.map(_chunk_digest, blocks))


def _kvstore_base(kv) -> dict:
    spec = kv.spec().to_json()
    spec.pop("path", None)
    return spec


def _zarr_dtype(dtype) -> str:
    name = np.dtype(dtype).name
    return {"bfloat16": "bfloat16"}.get(name, name)


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)
