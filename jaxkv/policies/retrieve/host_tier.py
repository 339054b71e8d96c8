"""The selection buffer of the shared retrieval methods (SpeContext) and its host tier: the elastic diff of
adjacent selections (driven by `jaxkv.policies.retrieve.buffer`).

A shared retrieval policy (SpeContext) reads, in every layer from its tap on, the same per-(sequence, KV
head) selection of B positions. The engine keeps those positions' K/V in a persistent device buffer per
state row, `SelBuffer` (``k, v``: one ``[R, Hkv, W, D]`` per layer, ``pos [R, Hkv, W]``, W = B rounded up
to the page size, -1 = empty slot), and each step moves only what the selection gained (the paper's
elastic loading):

* `plan_diff`: which selected positions the buffer lacks, which buffer slots they go to (slots whose
  position left the selection, or empty ones), the buffer's positions after the step. Slots that stay
  selected are not touched, so the order inside the buffer is arbitrary: attention masks by position.
* `load_rows`: the lacking rows of every buffered layer, compacted over the whole batch, as one flat row
  copy: from the device pool in one round of every entry, or from the **host mirror** of the pool
  (``pinned_host`` memory) in rounds of ``chunk`` rows (a `lax.while_loop`; the gather runs on the host
  through `compute_on`, only the ``[Lsel, chunk, D]`` block crosses to the device).
* `mirror_slots`: copies newly written pool slots into the host mirror (after each engine call that wrote
  the pool for retrieval requests; a scatter XLA runs on the host in place, `_host_writer`), so the mirror
  holds every position written before a decode dispatch; positions written inside the dispatch are loaded
  from the device pool instead.

Host-to-device bytes of a step = rounds x chunk rows x Lsel x 2 (K, V) x D x itemsize; re-fetching the
selection would move every selected row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on

from jaxkv.cache.memory_kinds import device_sharding, host_memory_kind, host_sharding, to_host  # noqa: F401

# A host load round moves 1/split of the batch's selected rows (padding <= one round per step, in bytes
# that cross to the device). Device loads run as one round of every entry instead: a data-dependent
# while-loop on a GPU reads its predicate back to the host every round, a stall that cost more than the
# copies (docs/specontext.md, "The load").
HOST_SPLIT = 16
# Overlapped loads (`start_loads`): rounds gathered beside the layers before theirs; a step whose diff is
# larger loads the rest in serial rounds. 1 round = 1/16 of the batch's selection, above the ~2.6 % a step
# of the embedded model's head needs with a resident buffer (docs/specontext.md, "Overlapped host loads").
OVERLAP_ROUNDS = 1


def layer_groups(layers: int) -> list[range]:
    """Buffered layers in groups of doubling size (1, 1, 2, 4, ...): one host gather per group, so a step
    has ~log2(layers) host computations, and group g's runs beside the layers of the groups before it."""
    groups, start, size = [], 0, 1
    while start < layers:
        groups.append(range(start, min(layers, start + size)))
        start += size
        size = size if len(groups) == 1 else 2 * size
    return groups


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SelBuffer:
    """Selected K/V of the layers from the tap on: k, v, one [R, Hkv, W, D] array per buffered layer (pool
    dtype; separate arrays, so a layer's load never writes an array an earlier layer's attention read:
    with one stacked array XLA copied the whole buffer for every layer's overlapped write). Per slot
    [R, Hkv, W]: `pos` the position attention reads (-1 = not in this step's selection), `held` the position
    whose K/V the slot holds (-1 = empty; a slot keeps it after its position leaves the selection, so a
    position selected again later needs no load while its slot was not reused), `seen` the query position
    of the step that last selected it (the eviction order when W exceeds the budget)."""

    k: tuple
    v: tuple
    pos: jax.Array
    held: jax.Array
    seen: jax.Array

    @property
    def shape(self) -> tuple:
        """(layers, rows, KV heads, width, head dim)."""
        return (len(self.k), *self.k[0].shape)


def init_buffer(layers: int, rows: int, num_kv_heads: int, width: int, head_dim: int, dtype) -> SelBuffer:
    shape = (rows, num_kv_heads, width, head_dim)
    def empty():   # separate arrays, not one: the decode donates the buffer's leaves
        return jnp.full((rows, num_kv_heads, width), -1, jnp.int32)

    return SelBuffer(tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
                     tuple(jnp.zeros(shape, dtype) for _ in range(layers)), empty(), empty(), empty())


def forget_rows(buf: SelBuffer, rows) -> SelBuffer:
    """Empties buffer rows `rows` (out-of-range entries are ignored): a new request starts with nothing."""
    return dataclasses.replace(buf, **{f: getattr(buf, f).at[rows].set(-1, mode="drop")
                                       for f in ("pos", "held", "seen")})


def _search(sorted_vals, queries):
    """Per leading index: the insertion point of each query in the ascending last axis (unrolled binary
    search: one fusion of gathers, no device while-loop per search)."""
    return jax.vmap(functools.partial(jnp.searchsorted, method="scan_unrolled"))(
        sorted_vals.reshape(-1, sorted_vals.shape[-1]), queries.reshape(-1, queries.shape[-1])
    ).reshape(queries.shape)


def plan_diff(buf_pos, idx, count):
    """buf_pos [S, Hkv, W] (-1 empty, unique positions), idx [S, Hkv, B] ascending selection with count
    [S, Hkv] -> (pos [S, Hkv, W] the buffer's positions after the step (-1 where not selected), need
    [S, Hkv, B] selected entries the buffer lacked, dest [S, Hkv, B] the buffer slot of every selected entry
    (W where none))."""
    pos, _, _, need, dest = plan_resident(buf_pos, jnp.full_like(buf_pos, -1), idx, count,
                                          jnp.zeros(idx.shape[:1], jnp.int32))
    return pos, need, dest


def plan_resident(held, seen, idx, count, stamp):
    """The diff of a resident buffer: held / seen [S, Hkv, W] (see SelBuffer), idx [S, Hkv, B] ascending
    selection with count [S, Hkv], stamp [S] this step's query position -> (pos, held, seen after the step,
    need [S, Hkv, B] selected entries no slot holds, dest [S, Hkv, B] the slot of every selected entry, W
    where none). A lacking position takes a slot not selected now: when W exceeds the selection, the
    empty slots first, then the least recently selected (LRU over `seen`)."""
    buf_pos = held
    w = buf_pos.shape[-1]
    b = idx.shape[-1]
    big = jnp.iinfo(jnp.int32).max
    sel = jnp.arange(b) < count[..., None]
    order = jnp.argsort(jnp.where(buf_pos >= 0, buf_pos, big), axis=-1).astype(jnp.int32)
    held_sorted = jnp.take_along_axis(jnp.where(buf_pos >= 0, buf_pos, big), order, axis=-1)
    at = jnp.minimum(_search(held_sorted, idx), w - 1)
    hit = sel & (jnp.take_along_axis(held_sorted, at, axis=-1) == idx)
    sel_sorted = jnp.where(sel, idx, big)
    at2 = jnp.minimum(_search(sel_sorted, buf_pos), b - 1)
    keep = (buf_pos >= 0) & (jnp.take_along_axis(sel_sorted, at2, axis=-1) == buf_pos)
    free = ~keep
    lead = jnp.indices(free.shape[:-1] + (1,), sparse=True)[:-1]
    if w > b:   # more slots than the selection: evict empty slots, then the least recently selected
        age = jnp.where(keep, big, jnp.where(buf_pos >= 0, seen, -1))
        free_list = jnp.argsort(age, axis=-1, stable=True).astype(jnp.int32)
    else:       # every free slot is refilled or emptied: slot order, no sort
        free_rank = jnp.where(free, jnp.cumsum(free, axis=-1) - 1, w)
        free_list = jnp.full(free.shape, w, jnp.int32).at[(*lead, free_rank)].set(
            jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), free.shape), mode="drop")
    need = sel & ~hit
    need_rank = jnp.maximum(jnp.cumsum(need, axis=-1) - 1, 0)
    dest = jnp.where(hit, jnp.take_along_axis(order, at, axis=-1),
                     jnp.where(need, jnp.take_along_axis(free_list, need_rank, axis=-1), w))
    at_dest = (*lead, dest)
    pos = jnp.full_like(buf_pos, -1).at[at_dest].set(idx, mode="drop")
    held = buf_pos.at[at_dest].set(idx, mode="drop")
    now = jnp.broadcast_to(stamp.astype(jnp.int32)[:, None, None], idx.shape)
    seen = seen.at[at_dest].set(now, mode="drop")
    return pos, held, seen, need, dest


def _pool_slots(page_table, pos, page_size: int):
    """Flat pool slots of entries (s, h, position) in every buffered layer: page_table [S, Lsel, Hkv, P],
    s/h/position [C] -> [Lsel, C] (0 where the page is missing)."""
    s, h, p = pos
    pages = page_table[s, :, h, jnp.maximum(p, 0) // page_size]  # [C, Lsel]
    return jnp.where(pages >= 0, pages * page_size + (jnp.maximum(p, 0) % page_size)[:, None], 0).T


def _host_space():
    """The host memory space of `out_memory_spaces` (public `jax.memory.Space` where this jax has it)."""
    space = getattr(getattr(jax, "memory", None), "Space", None)
    if space is None:
        from jax._src.core import MemorySpace as space
    return space.Host


def _on_host(f, num_outputs: int, form: str | None = None):
    """`f` run on the host with its `num_outputs` results in host memory, or None where this jax offers
    neither form (then the host tier is unavailable and `Retriever` says so at construction).

    form "context": `compute_on("device_host")(jit(f))` (jax <= 0.10's context-manager API); "keyword":
    `compute_on2(f, compute_type="device_host", out_memory_spaces=...)`, which jax 0.11 exports as
    `compute_on` itself; None: the first form this jax takes."""
    import jax.experimental.compute_on as con

    if form in (None, "context"):
        try:
            return compute_on("device_host")(jax.jit(f))
        except TypeError:
            if form == "context":
                raise
    keyword = getattr(con, "compute_on2", None) or compute_on
    try:
        return keyword(jax.jit(f), compute_type="device_host",
                       out_memory_spaces=(_host_space(),) * num_outputs)
    except (TypeError, ImportError):
        if form == "keyword":
            raise
        return None


def _gather_host_rows(host_k, host_v, rows):
    """On the host: host_k/v [N, D], rows [...] -> [..., D] each."""
    return host_k[rows], host_v[rows]


_host_gather = _on_host(_gather_host_rows, 2)
AVAILABLE = _host_gather is not None


def _gather(src, rows):
    """K/V rows [Lsel, C] from the device pool (src = pool) or the host mirror (src = (host_k, host_v))."""
    if isinstance(src, tuple):
        k, v = _host_gather(*src, jax.device_put(rows, host_sharding()))
        return jax.device_put(k, device_sharding()), jax.device_put(v, device_sharding())
    d = src.k.shape[-1]
    return src.k.reshape(-1, d)[rows], src.v.reshape(-1, d)[rows]


def _compact(load, chunk: int | None):
    """Entries to load, compacted: (order [rounds_max x chunk] flat entry ids (padding past n), n, chunk)."""
    flat = load.reshape(-1)
    n = jnp.sum(flat).astype(jnp.int32)
    chunk = flat.shape[0] if chunk is None else chunk
    rank = jnp.where(flat, jnp.cumsum(flat) - 1, flat.shape[0] + chunk)
    size = -(-flat.shape[0] // chunk) * chunk
    order = jnp.zeros((size,), jnp.int32).at[rank].set(jnp.arange(flat.shape[0], dtype=jnp.int32),
                                                       mode="drop")
    return order, n, chunk


def _round(buf_shape, order, n, start, size: int, page_table, buf_rows, idx, dest, page_size: int):
    """Entries order[start:start + size]: (pool rows [Lsel, size] of every buffered layer, flat destinations
    [size] in each layer's buffer (the same in every layer; padding: distinct, out of bounds, so the copy is
    a plain row copy))."""
    _, nrows, hkv, w, _ = buf_shape
    b = idx.shape[-1]
    e = jax.lax.dynamic_slice(order, (start,), (size,))
    real = start + jnp.arange(size) < n
    si, hi, ji = e // (hkv * b), (e // b) % hkv, e % b
    rows = _pool_slots(page_table, (si, hi, idx[si, hi, ji]), page_size)
    slot, row = dest[si, hi, ji], buf_rows[si]
    dst = (row * hkv + hi) * w + slot
    pad = nrows * hkv * w + jnp.arange(size, dtype=jnp.int32)
    return rows, jnp.where(real & (slot < w) & (row >= 0), dst, pad)


def _put(buf_k, buf_v, dst, k, v):
    """Rows k, v [C, D] into one layer's buffers [R, Hkv, W, D] at flat destinations dst [C] (unique;
    padding dropped)."""
    shape, d = buf_k.shape, buf_k.shape[-1]
    k_new = buf_k.reshape(-1, d).at[dst].set(k.astype(buf_k.dtype), mode="drop", unique_indices=True)
    v_new = buf_v.reshape(-1, d).at[dst].set(v.astype(buf_v.dtype), mode="drop", unique_indices=True)
    return k_new.reshape(shape), v_new.reshape(shape)


def _put_all(ks, vs, dst, k, v):
    """Rows k, v [Lsel, C, D] into every layer's buffers (tuples) at dst [C]."""
    out = [_put(ks[j], vs[j], dst, k[j], v[j]) for j in range(len(ks))]
    return tuple(o[0] for o in out), tuple(o[1] for o in out)


def _rounds(buf: SelBuffer, src, order, n, chunk: int, first: int, gather_args):
    """Round r of `chunk` entries for r >= 1 while entries remain past the first `first` (a while loop)."""
    def one(state):
        r, ks, vs = state
        rows, dst = _round(buf.shape, order, n, first + (r - 1) * chunk, chunk, *gather_args)
        k, v = _gather(src, rows)  # [Lsel, C, D]
        ks, vs = _put_all(ks, vs, dst, k, v)
        return r + 1, ks, vs

    rounds = 1 + (jnp.maximum(n - first, 0) + chunk - 1) // chunk
    _, ks, vs = jax.lax.while_loop(lambda st: st[0] < rounds, one, (jnp.int32(1), buf.k, buf.v))
    return dataclasses.replace(buf, k=ks, v=vs), rounds - 1


def load_rows(buf: SelBuffer, src, page_table, buf_rows, idx, dest, load, *, page_size: int,
              chunk: int | None):
    """Moves the selected entries `load` [S, Hkv, B] (positions idx, buffer slots dest) of every buffered
    layer into `buf` (k, v only; pos is the caller's), compacted over the batch, `chunk` rows per round
    (None: one round of every entry, no loop). page_table [S, Lsel, Hkv, P] of the buffered layers,
    buf_rows [S] the buffer row of each sequence. Returns (buf, rows moved: rounds x chunk, or the rows
    loaded for one round)."""
    order, n, size = _compact(load, chunk)
    gather_args = (page_table, buf_rows, idx, dest, page_size)
    if chunk is None:
        rows, dst = _round(buf.shape, order, n, 0, size, *gather_args)
        ks, vs = _put_all(buf.k, buf.v, dst, *_gather(src, rows))
        return dataclasses.replace(buf, k=ks, v=vs), n
    buf, rounds = _rounds(buf, src, order, n, size, 0, gather_args)
    return buf, rounds * size


def start_loads(buf: SelBuffer, src, page_table, buf_rows, idx, dest, load, *, page_size: int, chunk: int,
                first: int):
    """`load_rows` split for overlap: the first `first` entries are gathered in `layer_groups`, each group
    its own host computation with nothing on the device waiting for it but its layers' `finish_load`, so
    XLA's latency-hiding scheduler runs a group's gather beside the layers before it (docs/specontext.md,
    "Overlapped host loads"); entries past `first` (a step whose diff outgrew it) load now, `chunk` per
    round, as `load_rows` does. Returns (buf, rows moved: first + later rounds x chunk, pending: per
    buffered layer (k, v [first, D], flat destinations [first]))."""
    order, n, _ = _compact(load, chunk)
    order = jnp.pad(order, (0, max(0, first - order.shape[0])))
    gather_args = (page_table, buf_rows, idx, dest, page_size)
    rows, dst = _round(buf.shape, order, n, 0, first, *gather_args)
    pending = []
    for g in layer_groups(rows.shape[0]):
        k, v = _gather(src, rows[g.start:g.stop])
        pending += [(k[i], v[i], dst) for i in range(len(g))]
    buf, rounds = _rounds(buf, src, order, n, chunk, first, gather_args)
    return buf, first + rounds * chunk, tuple(pending)


def finish_load(buf: SelBuffer, layer: int, pending) -> SelBuffer:
    """Writes buffered layer `layer`'s pending rows (`start_loads`) into its buffer, right before the layer
    reads it."""
    k, v = _put(buf.k[layer], buf.v[layer], pending[2], pending[0], pending[1])
    return dataclasses.replace(buf, k=buf.k[:layer] + (k,) + buf.k[layer + 1:],
                               v=buf.v[:layer] + (v,) + buf.v[layer + 1:])


@functools.cache
def _host_writer(f):
    """`f(host_k, host_v, ...) -> (host_k, host_v)` jitted with the mirror donated and its results placed in
    host memory. XLA then runs the scatter on the host *in place*: on an H100 (jax 0.11.2) a write of 8K rows
    into an 8M-row mirror takes ~1.5 ms this way, where a `compute_on("device_host")` scatter
    returned a new mirror and cost 340-430 ms, a copy of the whole mirror per write (docs/specontext.md,
    "In-place mirror writes"). The CPU backend still copies (harmless at test sizes)."""
    host = host_sharding()
    return jax.jit(f, donate_argnums=(0, 1), out_shardings=(host, host))


def _mirror_slots(host_k, host_v, pool_k, pool_v, slots):
    d = pool_k.shape[-1]
    flat = slots.reshape(-1)
    k = pool_k.reshape(-1, d)[jnp.maximum(flat, 0)]
    v = pool_v.reshape(-1, d)[jnp.maximum(flat, 0)]
    rows = jnp.where(flat >= 0, flat, host_k.shape[0])
    return (host_k.at[rows].set(k.astype(host_k.dtype), mode="drop"),
            host_v.at[rows].set(v.astype(host_v.dtype), mode="drop"))


def _move_host_rows(host_k, host_v, src, dst):
    src = jax.device_put(src, host_sharding())  # a gather needs its operands in one memory space
    return (host_k.at[dst].set(host_k[src], mode="drop"), host_v.at[dst].set(host_v[src], mode="drop"))


def mirror_slots(host_k, host_v, pool_k, pool_v, slots):
    """Copies the pool's flat slots `slots` (any shape, -1 = none) into the host mirror (donated, written in
    place where the backend can)."""
    return _host_writer(_mirror_slots)(host_k, host_v, pool_k, pool_v, slots)


def move_host_rows(host_k, host_v, src, dst):
    """Copies host mirror rows `src` [T] to rows `dst` [T] (out of range: dropped; the offload of pages)."""
    return _host_writer(_move_host_rows)(host_k, host_v, src, dst)


def transfer_bytes(rows: int, layers: int, head_dim: int, itemsize: int) -> int:
    """Host -> device bytes of moving `rows` (sequence, KV head) rows of `layers` layers, K + V."""
    return 2 * rows * layers * head_dim * itemsize
