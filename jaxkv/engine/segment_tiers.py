"""Segment tiers: where a registered segment's K/V live (device pool pages, host memory, the persistent
store) and the moves between them, per (layer, KV head).

* **device**: ``entry.pages[l, h]`` are pool pages; -1 where that head is not on the device (a segment
  promoted for a method that reads some heads only).
* **host**: a copy of every head: numpy on the CPU; on an accelerator that offers a host memory kind
  (JAX memory kinds, ``pinned_host``), one pinned host array per (layer, KV head), so a promotion moves
  only the heads it needs. Segments never change once registered, so a copy is kept when its segment is
  promoted and a later demotion moves nothing.
* **store**: the tensorstore store of ``--segment-store`` (jaxkv/engine/segment_persist.py). Every
  registration is written there, so leaving host memory moves nothing either.

Every segment is complete (every head) in at least one tier. **Demotion**: when an allocation (a request's
pages, a registration, a promotion) finds the pool short, the least recently used segments nobody is
using and nobody pinned leave the device: copied to host memory while the host budget (`host_bytes`,
``--segment-host-bytes``) holds them, else (with a store) dropped to the store; past the budget, host
copies another tier holds whole go first, least recently used first.

**Without a store** host memory is the lowest tier. A frozen segment is never dropped: a frozen
registration is refused (`SegmentCapacityError`, naming the budget) unless every segment pinned in host
memory fits its budget together. An ordinary segment is a cache entry: when no tier has room for it, the
least recently used one is dropped (its id becomes unknown; a request that gives its tokens registers it
again), which is what happens to ordinary segments without tiers too, only later.

**Promotion**: before a reuse request's prefill, the heads its method reads (`ReusePolicy.segment_heads`:
every head for naive / SparseX / CacheBlend / EPIC, the local heads only for RedKnot, which recomputes its
global heads' K/V for every token) and the device lacks are copied into newly allocated pages, from host
memory or the store (a store read started when the request was queued: `prefetch`). Nothing is prefilled
again. Every segment's transfer is dispatched before any is written, and before the prefill pass (JAX runs
them asynchronously), so host-side work of the pass overlaps the transfers. A reuse request defers it
(`promote(..., defer=True)` -> `Promotion`): its pass runs in layer groups, each group's pages written just
before that group's program, so the transfers of later groups run beside the earlier groups' layers
(jaxkv/engine/reuse.py, `LAYER_GROUPS`).

**Pins**: a frozen segment stays in the tier it was registered for: ``"device"`` (the default) never
leaves the pool; ``"host"`` is kept in host memory (its pool pages freed right after registration,
promoted for a request like any other, never dropped to the store).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.pool import KVPool
from jaxkv.cache.segments import SegmentEntry, SegmentError
from jaxkv.engine.config import SegmentConfig

log = logging.getLogger("jaxkv.engine")


class SegmentCapacityError(SegmentError):
    """A registration the tiers cannot hold now (host budget without a store, device pins)."""

TIERS = ("device", "host", "store")
PINS = ("device", "host")
DEFAULT_HOST_BYTES = SegmentConfig.host_bytes  # host memory for demoted segments (--segment-host-bytes)


@dataclasses.dataclass
class HostCopy:
    """Every (layer, KV head) of one segment in host memory: k, v [L * H, slots, D] (numpy) or a list of
    pinned host arrays [B * H, slots, D], one per block of B = `HOST_BLOCK_LAYERS` layers (the last block
    may hold fewer); pos [L * H, slots] int32 (numpy), or pinned [B * H, slots] blocks beside pinned K/V (a
    transfer of pageable numpy is synchronous: it would hold the host until the device has taken it)."""

    k: object
    v: object
    pos: object
    nbytes: int


class SegmentTiers:
    def __init__(self, reuser, host_bytes: int = DEFAULT_HOST_BYTES, memory_kinds: bool | None = None):
        if isinstance(host_bytes, bool) or not isinstance(host_bytes, int | np.integer) or host_bytes < 0:
            raise ValueError(f"segment_host_bytes must be an integer >= 0 (got {host_bytes!r})")
        self.reuser = reuser
        self.engine = reuser.engine
        self.store = reuser.store
        self.store.on_drop = self._forget
        self.host_bytes = int(host_bytes)
        cfg, pool = reuser.cfg, reuser.engine.runner.pool
        self.L, self.H, self.page_size = cfg.num_layers, cfg.num_kv_heads, reuser.page_size
        # bytes of one slot of one (layer, KV head): K + V + its int32 position
        self.slot_bytes = 2 * cfg.head_dim * pool.k.dtype.itemsize + 4
        if memory_kinds is None:
            from jaxkv.cache.memory_kinds import host_memory_kind

            memory_kinds = jax.default_backend() != "cpu" and host_memory_kind() is not None
        self.memory_kinds = bool(memory_kinds)
        self._host: OrderedDict[str, HostCopy] = OrderedDict()  # least recently used first
        self.pins: dict[str, str] = {}  # segment id -> "device" | "host" (frozen segments)
        self.promotions = 0  # segments (or some of their heads) copied up to the device
        self.demotions = 0  # segments moved off the device
        self.bytes_promoted = 0  # bytes copied to the device
        self.bytes_promoted_all_heads = 0  # what those promotions would have copied with every head
        self.bytes_demoted = 0  # bytes copied from the device to host memory
        self.drops = 0  # ordinary segments dropped because no tier had room (no store, host memory full)
        self._moves = 0  # tier changes so far: `totals` recomputes only after one (it runs every step)
        self._totals: tuple | None = None
        self._reads: dict[str, tuple[np.ndarray, object]] = {}  # store reads started ahead (`prefetch`)
        self.prefetch_hits = 0  # promotions served by a store read started when the request was queued
        self.last_reads: list = []  # the store reads (`SegmentRead`) the last promotion moved
        self.first_write_at: float | None = None  # perf_counter when the last promotion wrote its first pages

    @property
    def persist(self):
        return self.reuser.persist

    # ---- where a segment is ---------------------------------------------------------------------
    def head_bytes(self, e: SegmentEntry) -> int:
        return e.pages.shape[2] * self.page_size * self.slot_bytes

    def device_heads(self, e: SegmentEntry) -> np.ndarray:
        """[L, H] bool: heads whose pages are in the pool."""
        return (e.pages >= 0).all(axis=2) if e.pages.shape[2] else np.ones(e.pages.shape[:2], bool)

    def stored(self, e: SegmentEntry) -> bool:
        return self.persist is not None and e.segment_id in self.persist.ids

    def tier_bytes(self, e: SegmentEntry) -> dict[str, int]:
        """Bytes of the segment's K/V + positions in each tier (0 = not there)."""
        full = self.L * self.H * self.head_bytes(e)
        return {"device": int(self.device_heads(e).sum()) * self.head_bytes(e) if e.pages.shape[2] else 0,
                "host": self._host[e.segment_id].nbytes if e.segment_id in self._host else 0,
                "store": full if self.stored(e) else 0}

    def tiers(self, e: SegmentEntry) -> list[str]:
        """The tiers holding any of the segment, fastest first."""
        b = self.tier_bytes(e)
        return [t for t in TIERS if b[t] or (t == "device" and e.pages.shape[2] == 0)]

    def totals(self) -> dict[str, int]:
        """Bytes per tier over every live segment (all namespaces)."""
        key = (self._moves, len(self.store), len(self.persist.ids) if self.persist is not None else 0)
        if self._totals is not None and self._totals[0] == key:
            return dict(self._totals[1])
        out = dict.fromkeys(TIERS, 0)
        for e in self.store.entries(all_namespaces=True):
            for t, b in self.tier_bytes(e).items():
                out[t] += b
        self._totals = (key, out)
        return dict(out)

    @property
    def host_used(self) -> int:
        return sum(c.nbytes for c in self._host.values())

    # ---- registration ---------------------------------------------------------------------------
    def check_pin(self, frozen: bool, tier: str | None) -> str | None:
        """The pin of a registration: "device" for a frozen segment unless `tier` says "host"."""
        if tier is not None and tier not in PINS:
            raise ValueError(f"tier must be one of {list(PINS)} (got {tier!r})")
        if tier is not None and not frozen:
            raise ValueError("tier pins a frozen segment where it stays; pass frozen=True with it")
        return (tier or "device") if frozen else None

    def admit(self, num_tokens: int, pin: str | None, existing: SegmentEntry | None = None) -> None:
        """Refuses (SegmentCapacityError) a frozen registration the tiers could not keep: without a store,
        the segments pinned in host memory must fit its budget together; the segments pinned to the device
        may not leave the pool without room for one request of the full context. Ordinary segments are
        always admitted (they may be dropped when no tier has room)."""
        npg = -(-num_tokens // self.page_size)
        size = self.L * self.H * npg * self.page_size * self.slot_bytes
        others = [e for e in self.store.entries(all_namespaces=True) if e is not existing]
        if pin == "device":
            pinned = sum(e.pages.shape[2] for e in others if self.pins.get(e.segment_id) == "device")
            reserve = self.engine.tables.pages_needed(None, self.engine.max_model_len)
            room = self.engine.allocator.num_pages - reserve
            want = (pinned + npg) * self.L * self.H
            if want > room:
                total = self.engine.allocator.num_pages
                raise SegmentCapacityError(
                    f"segments frozen on the device would hold {want} of the pool's {total} pages, leaving "
                    "no room for a request of the full context; freeze it with tier='host' or delete frozen "
                    "segments")
        elif pin == "host" and self.persist is None:
            pinned = sum(self.L * self.H * self.head_bytes(e) for e in others
                         if self.pins.get(e.segment_id) == "host")
            if pinned + size > self.host_bytes:
                raise SegmentCapacityError(
                    f"segments frozen in host memory would need {pinned + size} bytes; the budget is "
                    f"{self.host_bytes} (--segment-host-bytes) and no segment store is configured "
                    "(--segment-store)")

    def pin(self, e: SegmentEntry, pin: str | None) -> None:
        """Applies a registration's pin: a device pin brings every head to the pool, a host pin moves the
        segment to host memory now."""
        if pin is None:
            return
        self.pins[e.segment_id] = pin
        if pin == "device":
            self.promote([e], np.ones((self.L, self.H), bool))
        elif e.refcount == 0:
            self._demote(e, keep_host=True)

    # ---- demotion -------------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Moves idle, unpinned segments off the device, least recently used first, until at least
        `num_pages` pages are free again (or nothing more can go); returns pages freed. The scheduler and
        the reuse path call it when an allocation comes up short."""
        freed = 0
        for e in self.store.entries(all_namespaces=True):
            if freed >= num_pages:
                break
            if e.refcount or self.pins.get(e.segment_id) == "device" or not (e.pages >= 0).any():
                continue
            freed += self._demote(e)
        return freed

    def place(self, e: SegmentEntry, tier: str) -> None:
        """Puts an idle segment wholly in `tier` and in no faster one: "device" promotes every head; "host"
        leaves a host copy and frees its pool pages; "store" keeps only the store's copy. For benchmarks and
        operators that want a known starting tier; pins are not changed (a pinned segment refuses)."""
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {list(TIERS)} (got {tier!r})")
        sid = e.segment_id
        if e.refcount:
            raise SegmentError(f"segment {sid!r} is in use by a request")
        if sid in self.pins and self.pins[sid] != tier:
            raise SegmentError(f"segment {sid!r} is pinned to {self.pins[sid]!r}")
        if tier == "device":
            self.promote([e], np.ones((self.L, self.H), bool))
            return
        if tier == "host":
            if sid not in self._host:
                self._make_host_room(self.L * self.H * self.head_bytes(e), hard=True, before=sid)
                if not self.device_heads(e).all():
                    self.promote([e], np.ones((self.L, self.H), bool))  # the copy is made from the pool
                self._host[sid] = self._copy_out(e)
                self.bytes_demoted += self.L * self.H * self.head_bytes(e)
            self._demote(e)
            return
        if not self.stored(e):
            raise SegmentError(f"segment {sid!r} is not in a segment store (--segment-store)")
        if self._host.pop(sid, None) is not None:
            self._moves += 1
        self._free_device(e)  # the store holds it: the pages just go, no host copy is made

    def _demote(self, e: SegmentEntry, keep_host: bool = False) -> int:
        """Frees the segment's pool pages, first copying it to host memory unless a lower tier holds it
        (and, with a store, only while the host budget allows); returns pages freed, 0 when it must stay."""
        on = e.pages >= 0
        if not on.any():
            return 0
        sid = e.segment_id
        if sid not in self._host:
            size = self.L * self.H * self.head_bytes(e)
            complete = bool(self.device_heads(e).all())
            pinned = keep_host or self.pins.get(sid) == "host"
            if complete and self._make_host_room(size, hard=pinned, before=sid):
                self._host[sid] = self._copy_out(e)
                self.bytes_demoted += size
            elif self.stored(e):
                pass  # the store holds it: the pages just go
            elif pinned or not complete:
                log.warning("jaxkv: segment %s stays on the device: no lower tier holds it", sid)
                return 0
            else:  # no tier has room: an ordinary segment goes (its tokens register again on use)
                n = int(on.sum())
                self.store.drop(e)
                self.drops += 1
                self._moves += 1
                return n
        else:
            self._host.move_to_end(sid)
        return self._free_device(e)

    def _free_device(self, e: SegmentEntry) -> int:
        """Returns the segment's pool pages (a lower tier holds it); pages freed."""
        on = e.pages >= 0
        n = int(on.sum())
        if n:
            self._moves += 1
            self.engine.allocator.decref(e.pages[on])
            e.pages = np.full_like(e.pages, -1)
            self.demotions += 1
        return n

    def _make_host_room(self, size: int, hard: bool, before: str | None = None) -> bool:
        """Frees host memory until `size` more bytes fit the budget, least recently used first: copies of
        segments another tier holds whole (the store, or the device), then ordinary idle segments held
        nowhere else, if used less recently than segment `before` (they are dropped). Pinned copies stay.
        `hard`: the copy is needed (a pinned segment), so it is made even past the budget."""
        used = self.host_used
        order = {sid: i for i, sid in enumerate(self.store._entries)}
        limit = order.get(before, len(order))
        for sid in list(self._host):
            if used + size <= self.host_bytes:
                break
            e = self.store._entries.get(sid)
            if e is None or self.pins.get(sid) == "host":
                continue
            if self.stored(e) or self.device_heads(e).all():
                used -= self._host.pop(sid).nbytes
                self._moves += 1
            elif not e.frozen and e.refcount == 0 and order[sid] < limit:
                used -= self._host[sid].nbytes
                self.store.drop(e)  # its host copy goes with it (`_forget`)
                self.drops += 1
                self._moves += 1
        return used + size <= self.host_bytes or hard

    def _copy_out(self, e: SegmentEntry) -> HostCopy:
        """Every head's pages of a segment complete on the device, read into host memory."""
        L, H, npg = e.pages.shape
        pool, ps = self.engine.runner.pool, self.page_size
        ids = jnp.asarray(e.pages.reshape(L * H, npg))
        k = pool.k[ids].reshape(L * H, npg * ps, -1)
        v = pool.v[ids].reshape(L * H, npg * ps, -1)
        pos = pool.pos[ids].reshape(L * H, npg * ps)
        if self.memory_kinds:
            from jaxkv.cache.memory_kinds import host_sharding

            rows = [slice(a * H, b * H) for a, b in host_blocks(L)]
            k, v, pos = (jax.device_put([x[r] for r in rows], host_sharding()) for x in (k, v, pos))
        else:
            k, v, pos = np.asarray(k), np.asarray(v), np.asarray(pos)
        return HostCopy(k, v, pos, L * H * npg * ps * self.slot_bytes)

    def _unpromote(self, mv: _Move) -> None:
        """A move whose store read failed its checks: its new pages go back, the entry names none of them
        (the segment stays in the store, and a later request reads it again)."""
        mv.entry.pages[mv.missing] = -1
        self.engine.allocator.decref(mv.ids)
        self._moves += 1
        self.promotions -= 1
        self.bytes_promoted -= mv.counted[0]
        self.bytes_promoted_all_heads -= mv.counted[1]

    def _forget(self, e: SegmentEntry) -> None:
        """A segment left the store (deleted): its host copy, pin and any read ahead go with it."""
        self._drop_read(e.segment_id)
        self._host.pop(e.segment_id, None)
        self.pins.pop(e.segment_id, None)
        self._moves += 1

    # ---- promotion ------------------------------------------------------------------------------
    def promote(self, entries, heads: np.ndarray, defer: bool = False) -> Promotion | None:
        """Brings heads [L, H] of every entry (in use by the caller, so none of them is demoted meanwhile)
        to the device: from host memory, else from the store. Raises OutOfPages when the pool has no room
        (nothing changed for the entry that failed), SegmentError when the store's copy is unreadable.

        Every segment's transfer is started before any of them is written into its pages: a host-to-device
        copy queued behind a running program waits for it, one queued first runs beside it (H200: 2 GB of
        pinned arrays beside a 78 ms program, 88 ms put first vs 118 ms put second).

        `defer`: the entries' pages are allocated and set (`entry.pages`) but nothing moves yet; returns the
        `Promotion` (None when every head is already on the device) whose `start` / `write` the caller runs
        per layer group around its own programs, and whose `finish` it must call in any case."""
        heads = np.asarray(heads, bool)
        moves: list[_Move] = []
        try:
            for e in {x.segment_id: x for x in entries if x is not None}.values():
                absent = ~self.device_heads(e)
                missing = heads & absent
                if not missing.any():
                    self._drop_read(e.segment_id)  # already on the device: a read ahead is not needed
                    continue
                npg = e.pages.shape[2]
                heads_of = np.nonzero(missing)[1].repeat(npg)  # each page's KV head (a TP pool places by it)
                ids = self.reuser._allocate(len(heads_of), heads=heads_of).reshape(-1, npg)
                try:
                    k, v, pos, read = self._stage(e, missing)
                except Exception:
                    self.engine.allocator.decref(ids)
                    raise
                if isinstance(k, list):  # pinned host copies move whole blocks of layers
                    B = k[0].shape[0] // self.H
                    moved = sum(b - a for a, b in host_blocks(self.L, B) if missing[a:b].any()) * self.H
                else:
                    moved = int(missing.sum())
                counted = (moved * self.head_bytes(e), int(absent.sum()) * self.head_bytes(e))
                moves.append(_Move(missing, ids, k, v, pos, e, read, counted))
                e.pages[missing] = ids
                if e.segment_id in self._host:
                    self._host.move_to_end(e.segment_id)
                self.promotions += 1
                self._moves += 1
                self.bytes_promoted += counted[0]
                self.bytes_promoted_all_heads += counted[1]
        except BaseException:  # the segments planned so far are promoted, also when a later one failed
            Promotion(self, moves).finish(report=False)
            raise
        promotion = Promotion(self, moves)
        self.last_reads = [mv.read for mv in moves if mv.read is not None]
        if not defer:
            promotion.finish()  # store reads move on layer piece by layer piece as they are checked
            return None
        try:  # the caller's pass reads these pages: every store read is checked before it runs
            promotion.check()
        except SegmentError:
            promotion.finish(report=False)
            raise
        return promotion if moves else None

    def prefetch(self, entries, heads: np.ndarray) -> None:
        """Starts reading from the store, on a background thread, the heads [L, H] of each entry that no
        faster tier holds, so a queued request's promotion finds them read (the read overlaps the steps
        that run meanwhile). Called when a reuse request is queued."""
        if self.persist is None:
            return
        heads = np.asarray(heads, bool)
        for e in entries:
            sid = e.segment_id
            missing = heads & ~self.device_heads(e)
            if not missing.any() or sid in self._host or sid in self._reads or not self.stored(e):
                continue
            try:
                self._reads[sid] = (missing, self.persist.disk.read(sid, missing))
            except Exception:  # e.g. deleted meanwhile: the promotion reads again and reports it
                continue

    def _drop_read(self, sid: str) -> None:
        ahead = self._reads.pop(sid, None)
        if ahead is not None:
            ahead[1].cancel()  # layers not started yet are never read; its arrays go with it

    def _read_store(self, e: SegmentEntry, missing: np.ndarray):
        """The store's copy of the `missing` heads: from a read `prefetch` started when it covers them."""
        ahead = self._reads.pop(e.segment_id, None)
        if ahead is not None and not (missing & ~ahead[0]).any() and not ahead[1].failed():
            self.prefetch_hits += 1
            return ahead[1]
        if ahead is not None:
            ahead[1].cancel()
        # a failed read ahead is read again: the error reported is the one of the read the request waits on
        return self.persist.disk.read(e.segment_id, heads=missing)

    def _stage(self, e: SegmentEntry, missing: np.ndarray):
        """The `missing` heads' K/V on the host: (k, v, pos, read). k, v: a list of L pinned host arrays
        [H, slots, D] (a pinned copy, which moves whole layers) or numpy [L * H, slots, D] whose missing rows
        hold the heads; pos: L pinned [H, slots] arrays with pinned K/V, else numpy [L * H, slots]. From the
        store, `read` is the `SegmentRead` still filling k, v, pos (wait for a layer before moving it), else
        None."""
        c = self._host.get(e.segment_id)
        if c is not None:
            self._drop_read(e.segment_id)
            return c.k, c.v, c.pos, None
        if not self.stored(e):
            raise SegmentError(f"segment {e.segment_id!r} is in no tier that holds its heads")
        from jaxkv.cache.segment_store import CorruptSegmentError

        try:
            read = self._read_store(e, missing)
        except (CorruptSegmentError, KeyError) as err:
            raise unreadable(e, err) from None
        L, H, slots = read.pos.shape
        self.persist.bytes_read += int(missing.sum()) * slots * self.slot_bytes
        return (read.k.reshape(L * H, slots, -1), read.v.reshape(L * H, slots, -1),
                read.pos.reshape(L * H, slots), read)

    # ---- reads for the store --------------------------------------------------------------------
    def arrays(self, e: SegmentEntry):
        """Every head's K, V [L, H, slots, D] and positions [L, H, slots] as numpy, from the fastest tier
        holding the whole segment (for writing it to the store)."""
        L, H, npg = e.pages.shape
        slots = npg * self.page_size
        if self.device_heads(e).all():
            pool = self.engine.runner.pool
            ids = e.pages.reshape(-1)
            return (np.asarray(pool.k[ids]).reshape(L, H, slots, -1),
                    np.asarray(pool.v[ids]).reshape(L, H, slots, -1),
                    np.asarray(pool.pos[ids]).reshape(L, H, slots))
        c = self._host.get(e.segment_id)
        if c is None:
            seg = self.persist.disk.get(e.segment_id)
            return seg.k, seg.v, seg.pos
        k, v, pos = (np.concatenate([np.asarray(a) for a in x]) if isinstance(x, list) else x
                     for x in (c.k, c.v, c.pos))
        return k.reshape(L, H, slots, -1), v.reshape(L, H, slots, -1), pos.reshape(L, H, slots)



STORE_PIECE_LAYERS = 4  # layers of a store read moved per transfer, as soon as they are read and checked
# Layers per pinned host array of a host copy. Every array is one transfer, and the host pays a fixed cost to
# issue each (a promotion of 8 segments at the 8B shape issued ~700 per-layer arrays in ~130 ms, longer than
# the ~82 ms the link needed); per head (~1 MB) the link itself reached half its speed (H100: 23 GB/s for
# 1 MB arrays, 48-53 GB/s from 8 MB). A promotion moves whole blocks holding a head it needs.
HOST_BLOCK_LAYERS = 4


def unreadable(e: SegmentEntry, err: Exception) -> SegmentError:
    return SegmentError(f"segment {e.segment_id!r} cannot be read from the segment store: {err}")


@dataclasses.dataclass
class _Move:
    """One segment's heads on their way to the device: `missing` [L, H], their new pages `ids` [m, npg] (in
    the flattened order of `missing`), K/V and positions on the host (`SegmentTiers._stage`); `read`: the
    store read filling them (None: already on the host)."""

    missing: np.ndarray
    ids: np.ndarray
    k: object
    v: object
    pos: np.ndarray
    entry: SegmentEntry | None = None
    read: object = None
    counted: tuple[int, int] = (0, 0)  # bytes it adds to `bytes_promoted`, `bytes_promoted_all_heads`
    failed: bool = False


@dataclasses.dataclass
class _Piece:
    """Layers [l0, l1) of a move's store read: rows `sel` of its host K, V, positions once `wait` returned."""

    move: _Move
    l0: int
    l1: int
    sel: object

    def wait(self) -> None:
        self.move.read.wait(self.l0, self.l1)


class Promotion:
    """Promoted heads written into their pages per layer group, so a program over some layers depends only
    on those layers' transfers: `start` plans the groups and sends every group's page ids and rows in one
    transfer (small, pageable: synchronous, so it goes before any K/V is in flight), then the first groups'
    K/V; `send` the others' K/V and positions (one call per group, the first group's first); `write(g)`
    writes group g's pages (call it just before the program over those layers); `finish` sends and writes
    whatever is left (always call it: the entries already name these pages). One group of every layer is
    the plain promotion.

    A segment still being read from the store moves in pieces of `STORE_PIECE_LAYERS` layers, each sent as
    soon as its layers are read and checked, so the transfer of the first layers runs beside the read of the
    later ones. A read that fails its checks undoes that segment's move (its pages freed, never written)
    and is reported by `finish` (or `check`) as SegmentError once the other segments are written."""

    def __init__(self, tiers: SegmentTiers, moves: list[_Move]):
        self.tiers, self.moves = tiers, moves
        self.groups: list[tuple[int, int]] | None = None
        self._plans: list[list[_Part]] = []  # per group: one `_Part` per segment holding its layers
        self._meta: list[list] = []  # per group: (rows, page ids) on the device, per segment
        self._parts: list[list] = []  # per group sent: (k, v, pos) on the device per segment (None: failed)
        self._written: set[int] = set()
        self._moved: dict[int, jax.Array] = {}  # id of a pinned host block -> its copy on the device
        self.error: SegmentError | None = None  # the first store read that failed its checks

    def reads_pending(self) -> bool:
        """Whether a segment of this promotion still comes from a store read (its pieces not all read)."""
        return any(mv.read is not None and not mv.failed and not mv.read.finished for mv in self.moves)

    def check(self) -> None:
        """Waits for every store read of the promotion; raises SegmentError when one failed its checks (that
        segment's move undone, the others still to be written by `finish`)."""
        from jaxkv.cache.segment_store import CorruptSegmentError

        for mv in self.moves:
            if mv.read is not None and not mv.failed:
                try:
                    mv.read.wait()
                except CorruptSegmentError as err:
                    self._fail(mv, err)
        if self.error is not None:
            raise self.error

    def _fail(self, mv: _Move, err: Exception) -> None:
        mv.failed = True
        self.tiers._unpromote(mv)
        if self.error is None:
            self.error = unreadable(mv.entry, err)

    def start(self, groups: list[tuple[int, int]] | None = None, send: int | None = None) -> None:
        """Plans layer groups `groups` ([l0, l1) ranges covering every layer; default one group), sends
        every group's page ids and rows, and sends the first `send` groups' K/V (None: all)."""
        if self.groups is None:
            L, H = self.tiers.L, self.tiers.H
            self.groups = [(0, L)] if groups is None else [tuple(g) for g in groups]
            self._plans = [[p for p in (_part(mv, l0, l1, H) for mv in self.moves) if p is not None]
                           for l0, l1 in self.groups]
            self._meta = jax.device_put([[(p.rows, p.ids) for p in plan] for plan in self._plans])
        self.send(send)

    def send(self, upto: int | None = None) -> None:
        """Dispatches the K/V and positions of the groups before `upto` (None: every group) not sent yet:
        one transfer call per group for host copies (pinned host arrays move asynchronously), one per piece
        of layers for store reads, each once its layers are read."""
        from jaxkv.cache.memory_kinds import device_sharding
        from jaxkv.cache.segment_store import CorruptSegmentError

        for plan in self._plans[len(self._parts):upto]:
            ready = [p for p in plan if not p.pieces and not p.move.failed]
            flat = [x for p in ready for x in (*p.k, *p.v, *p.pos)]
            # a pinned block holding layers of two groups moves once, with the first
            pinned = list({id(x): x for x in flat if isinstance(x, jax.Array) and id(x) not in self._moved}
                          .values())
            pageable = [i for i, x in enumerate(flat) if not isinstance(x, jax.Array)]
            # pinned host arrays to the device's memory; numpy uncommitted, as a sharded pool's writes take it
            if pinned:
                for x, y in zip(pinned, jax.device_put(pinned, device_sharding())):
                    self._moved[id(x)] = y
            moved = [self._moved.get(id(x)) for x in flat]
            if pageable:
                for i, y in zip(pageable, jax.device_put([flat[i] for i in pageable])):
                    moved[i] = y
            moved = iter(moved)
            sent = {id(p): tuple(tuple(next(moved) for _ in x) for x in (p.k, p.v, p.pos)) for p in ready}
            for p in plan:
                if p.pieces and not p.move.failed:
                    try:
                        sent[id(p)] = _send_pieces(p)
                    except CorruptSegmentError as err:
                        self._fail(p.move, err)
            self._parts.append([sent.get(id(p)) for p in plan])

    def write(self, group: int) -> None:
        """Writes layer group `group`'s promoted pages into the pool (once), its transfers sent if not yet."""
        if group in self._written:
            return
        self.send(group + 1)
        self._written.add(group)
        runner = self.tiers.engine.runner
        for p, parts, (rows, ids) in zip(self._plans[group], self._parts[group], self._meta[group]):
            if parts is None or p.move.failed:  # its read failed: the pages were given back
                continue
            if self.tiers.first_write_at is None:
                self.tiers.first_write_at = time.perf_counter()
            k, v, pos = parts
            runner.pool = _write_pages(runner.pool, k, v, rows, ids, pos)

    def finish(self, report: bool = True) -> None:
        """Sends and writes every group not sent or written yet; then (`report`) raises SegmentError when a
        store read failed its checks."""
        self.start()
        for g in range(len(self.groups)):
            self.write(g)
        if report and self.error is not None:
            raise self.error


@dataclasses.dataclass
class _Part:
    """The heads of one move within one layer group: host K, V, position arrays (lists, concatenated in
    order by `_write_pages`), or `pieces` of a store read still under way; rows, page ids [m * npg]."""

    move: _Move
    k: list
    v: list
    pos: list
    rows: np.ndarray | None
    ids: np.ndarray
    pieces: list[_Piece] = dataclasses.field(default_factory=list)


def _send_pieces(p: _Part) -> tuple:
    """A store read's pieces to the device in layer order, each once read and checked (CorruptSegmentError
    otherwise): the first pieces move while later ones are still read."""
    k, v, pos = [], [], []
    for piece in p.pieces:
        piece.wait()
        mv = piece.move
        for out, host in zip((k, v, pos), (mv.k, mv.v, mv.pos)):
            out.append(jax.device_put(host[piece.sel]))
    return tuple(k), tuple(v), tuple(pos)


def _part(mv: _Move, l0: int, l1: int, H: int) -> _Part | None:
    """The heads of layers [l0, l1) of one move as `_write_pages` takes them once moved, or None when none
    of them is missing."""
    flat = np.nonzero(mv.missing.reshape(-1))[0]
    mine = (flat >= l0 * H) & (flat < l1 * H)
    if not mine.any():
        return None
    flat = flat[mine]
    ids = np.ascontiguousarray(mv.ids[mine].reshape(-1), np.int32)
    if isinstance(mv.k, list):  # pinned, per block of layers: the blocks holding a missing head move whole
        L = len(mv.missing)
        B = mv.k[0].shape[0] // H
        blocks = np.unique(flat // (B * H))
        starts = np.cumsum([0] + [(min((b + 1) * B, L) - b * B) * H for b in blocks[:-1]])
        base = dict(zip(blocks.tolist(), (starts - blocks * B * H).tolist()))
        rows = flat + np.array([base[b] for b in (flat // (B * H)).tolist()], np.int64)
        total = int(starts[-1]) + (min((int(blocks[-1]) + 1) * B, L) - int(blocks[-1]) * B) * H
        rows = None if len(rows) == total else rows.astype(np.int32)
        pos = ([mv.pos[b] for b in blocks] if isinstance(mv.pos, list)
               else [np.asarray(mv.pos[b * B * H:min((b + 1) * B, L) * H], np.int32) for b in blocks])
        return _Part(mv, [mv.k[b] for b in blocks], [mv.v[b] for b in blocks], pos, rows, ids)
    if mv.read is not None:  # a store read: pieces of layers, each taken once read
        pieces = []
        for a in range(l0, l1, STORE_PIECE_LAYERS):
            b = min(a + STORE_PIECE_LAYERS, l1)
            sub = flat[(flat >= a * H) & (flat < b * H)]
            if len(sub):
                pieces.append(_Piece(mv, a, b, _rows(sub)))
        return _Part(mv, [], [], [], None, ids, pieces)
    take = _rows(flat)
    return _Part(mv, [mv.k[take]], [mv.v[take]], [np.asarray(mv.pos[take], np.int32)], None, ids)


def host_blocks(num_layers: int, block: int | None = None) -> list[tuple[int, int]]:
    """The layer ranges [a, b) of a pinned host copy's arrays (`block` layers each; default
    `HOST_BLOCK_LAYERS`)."""
    B = max(1, HOST_BLOCK_LAYERS if block is None else block)
    return [(a, min(a + B, num_layers)) for a in range(0, num_layers, B)]


def _rows(flat: np.ndarray):
    """Rows `flat` (sorted) as a slice when contiguous (a view, no copy), else the index array."""
    a, b = int(flat[0]), int(flat[-1]) + 1
    return slice(a, b) if b - a == len(flat) else flat


@functools.partial(jax.jit, donate_argnums=0)
def _write_pages(pool: KVPool, k: tuple, v: tuple, rows, pages, pos: tuple) -> KVPool:
    """Heads' K/V and positions (the concatenation of `k`, `v` [n, slots, D] and `pos` [n, slots], at `rows`
    when given) written into pool pages [m * npg] as whole pages; a written slot's merge bias is cleared."""
    N, P, D = pool.k.shape

    def heads(parts):
        x = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
        return x if rows is None else x[rows]

    # Each page is written once (the ids are distinct): XLA may then write pages in parallel without ordering
    # colliding updates.
    put = lambda a, x: a.at[pages].set(x, unique_indices=True)  # noqa: E731
    bias = None if pool.bias is None else put(pool.bias, 0.0)
    k, v = (heads(x).reshape(-1, P, D).astype(pool.k.dtype) for x in (k, v))
    return KVPool(k=put(pool.k, k), v=put(pool.v, v), pos=put(pool.pos, heads(pos).reshape(-1, P)),
                  page_size=pool.page_size, bias=bias)
