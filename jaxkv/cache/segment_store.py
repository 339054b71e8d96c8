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
import time
from concurrent.futures import ThreadPoolExecutor
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
        m = self.meta(segment_id)
        if m is None:
            raise KeyError(segment_id)
        stored = np.asarray(m["heads"], bool)
        want = stored if heads is None else (np.asarray(heads, bool) & stored)
        L, H, slots, D = m["shape"]
        dtype = _np_dtype(m["dtype"])
        out = {"k": np.zeros((L, H, slots, D), dtype), "v": np.zeros((L, H, slots, D), dtype),
               "pos": np.full((L, H, slots), -1, np.int32)}
        chunks = m.get("chunk_checksums")
        read = want if chunks is not None else stored
        where = [(l_, h) for l_ in range(L) for h in range(H) if read[l_, h]]
        bad, digest = [], hashlib.blake2b(digest_size=16)
        try:
            for name in ("k", "v", "pos"):
                arr = self._array(segment_id, name)
                if len(where) == L * H:  # every head: one read, tensorstore fetches the chunks concurrently
                    out[name] = data = np.asarray(arr.read().result()).astype(out[name].dtype, copy=False)
                    blocks = [data[l_, h] for l_, h in where]
                else:
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
        return StoredSegment(segment_id, tuple(m["tokens"]), m["extra_key"], out["k"], out["v"], out["pos"],
                             want, tuple(m["context"]), m["frozen"], m["start"], m.get("extra", {}))

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
