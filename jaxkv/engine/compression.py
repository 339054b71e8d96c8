"""Engine side of the compression policies: when to compress, what to hand the device, what to free.

After a step, a request with a KV policy is compressed when its prefill has just finished and, for policies
with a `decode_interval`, every that many generated tokens. Requests due under the same policy go to the
device together (`jaxkv.policies.apply.compress`); the returned per-head counts shrink the host tables,
which free the pages past each head's new length. Host work is O(sequences), vectorised over heads.
"""

from __future__ import annotations

import numpy as np

from jaxkv.engine.buckets import bucket_for, powers_of_two
from jaxkv.policies.apply import compress
from jaxkv.policies.base import CompressPolicy


class Compressor:
    def __init__(self, engine):
        self.engine = engine
        cfg = engine.model.config
        hc = engine.head_classes
        sink, window = hc.sink_window_arrays(cfg.layer_windows)
        kinds = hc.kinds()
        lower = np.array([[c.lower for c in row] for row in hc.classes], np.int32)
        upper = np.array([[c.upper for c in row] for row in hc.classes], np.int32)
        # Local heads stay sink + window (their ring), retrieval heads belong to the retrieval policies.
        compressible = (window == 0) & (kinds != "local") & (kinds != "retrieval")
        self.heads = {"sink": sink.astype(np.int32), "window": window.astype(np.int32),
                      "compressible": compressible, "lower": lower, "upper": upper}
        self.max_upper = int(upper.max())
        # The twin when the engine runs the attention twin (CPU tests), else the dispatcher's choice.
        self.impl = "reference" if engine.runner.attn_impl == "reference" else None
        self.num_compressions = 0  # device calls since start
        self.pages_freed = 0

    def due(self, req) -> bool:
        pol: CompressPolicy | None = req.kv_policy
        if not isinstance(pol, CompressPolicy) or req.finished or req.num_computed < len(req.prompt_ids):
            return False
        if req.kv_compressed_at is None or req.kv_compressed_epoch != req.num_preemptions:
            return True  # prefill just ended (first time, or again after a preemption recomputed it)
        return bool(pol.decode_interval) and len(req.output_ids) - req.kv_compressed_at >= pol.decode_interval

    def after_step(self, requests) -> None:
        groups: dict[CompressPolicy, list] = {}
        for req in requests:
            if self.due(req):
                groups.setdefault(req.kv_policy, []).append(req)
        for pol, reqs in groups.items():
            self._run(pol, reqs)

    def _run(self, pol: CompressPolicy, reqs) -> None:
        eng = self.engine
        tables = eng.tables
        cfg = eng.model.config
        L, H = cfg.num_layers, cfg.num_kv_heads
        compressible = self.heads["compressible"]
        todo, targets = [], []
        for req in reqs:
            req.kv_compressed_at, req.kv_compressed_epoch = len(req.output_ids), req.num_preemptions
            target = pol.target_tokens(len(req.prompt_ids))
            lengths = tables.lengths(req.request_id)
            if compressible.any() and lengths[compressible].max() > target:
                todo.append(req)
                targets.append(target)
        if not todo:
            return
        S = bucket_for(len(todo), powers_of_two(max(eng.scheduler.max_num_seqs, len(todo))))
        W = pol.window
        P = bucket_for(max(tables.max_pages(r.request_id) for r in todo), eng._page_buckets)
        b = {"tokens": np.zeros((S, W), np.int32), "positions": np.full((S, W), -1, np.int32),
             "page_table": np.full((S, L, H, P), -1, np.int32), "lengths": np.zeros((S, L, H), np.int32),
             "target": np.zeros(S, np.int32), "recent_from": np.zeros(S, np.int32)}
        for row, (req, target) in enumerate(zip(todo, targets)):
            n = req.num_computed  # tokens whose K/V are cached; the last sampled one is not yet
            lo = max(0, n - W)
            ids = req.all_ids[lo:n]
            b["tokens"][row, W - len(ids):] = ids
            b["positions"][row, W - len(ids):] = np.arange(lo, n)
            b["target"][row] = target
            b["recent_from"][row] = n - pol.recent_tokens(target)
        tables.fill_step([r.request_id for r in todo], b["page_table"], b["lengths"])
        kmax = max(pol.max_count(int(max(targets)), H), self.max_upper, pol.sink + pol.recent_tokens(
            int(max(targets))))
        kmax = min(1 << (kmax - 1).bit_length(), P * eng.page_size)
        pool, counts = compress(eng.runner.params, eng.runner.pool, b, self.heads, cfg=cfg, policy=pol,
                                kmax=kmax, impl=self.impl)
        eng.runner.pool = pool
        counts = np.asarray(counts)
        for row, req in enumerate(todo):
            self.pages_freed += tables.compact(req.request_id, counts[row])
        self.num_compressions += 1
