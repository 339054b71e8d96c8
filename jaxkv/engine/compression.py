"""Engine side of the compression policies: when to compress, what to hand the device, what to free.

After a step, a request with a KV policy is compressed when its prefill has just finished and, for policies
with a `decode_interval`, every that many generated tokens. Requests due under the same policy go to the
device together (`jaxkv.policies.apply.compress`); the returned per-head counts shrink the host tables,
which free the pages past each head's new length. Host work is O(sequences), vectorised over heads.
"""

from __future__ import annotations

import numpy as np

from jaxkv.engine.buckets import bucket_for
from jaxkv.engine.programs import Programs
from jaxkv.policies.apply import compress
from jaxkv.policies.base import CompressPolicy

# Sequences per compression call; more due at once go in several calls. One: the observation pass gathers
# every cached key of a row per layer ([rows, Hkv, slots, D], plus [rows, Hq, window, slots] logits), so a
# row of a 32K width class is ~1 GB of temporaries at 1B and rows multiply it; and each press then has one
# program per page-table width class, which precompile covers before serving.
ROW_BUCKETS = (1,)


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
        # Programs compiled ahead of time (warmup.precompile): one per device form, rows and width class.
        self.compiled = Programs("compressor", owned=("cfg", "impl", "mesh"))

    # ---- programs ---------------------------------------------------------------------------------
    # A compression program depends on the policy's device form (its fields but the budget, which reaches
    # the device as each row's target), the rows (ROW_BUCKETS) and the page-table width class; the keep
    # buffer holds every slot of the width class, so the targets never change the program. Per press that
    # is rows x width classes variants, few enough to compile before serving (`warmup.precompile`).
    def batch(self, pol: CompressPolicy, S: int, P: int) -> dict:
        """An all-padding batch of S rows and P-page tables (no row compresses anything)."""
        cfg = self.engine.model.config
        L, H, W = cfg.num_layers, cfg.num_kv_heads, pol.window
        return {"tokens": np.zeros((S, W), np.int32), "positions": np.full((S, W), -1, np.int32),
                "page_table": np.full((S, L, H, P), -1, np.int32), "lengths": np.zeros((S, L, H), np.int32),
                "target": np.zeros(S, np.int32), "recent_from": np.zeros(S, np.int32)}

    def _call(self, pol: CompressPolicy, b: dict):
        P = b["page_table"].shape[-1]
        mesh = self.engine.runner.mesh
        static = dict(cfg=self.engine.model.config, policy=pol.device_form(), kmax=P * self.engine.page_size,
                      impl=self.impl)
        if mesh is not None:  # per shard over its KV heads; per-head policy fields in placed head order
            from jaxkv.parallel.methods import placed_policy

            static.update(mesh=mesh, policy=placed_policy(static["policy"],
                                                          getattr(self.engine.model, "kv_head_perm", None)))
        return compress, (self.engine.runner.params, self.engine.runner.pool, b, self.heads), static

    def call(self, pol: CompressPolicy, S: int, P: int):
        """(signature, function, arguments, static arguments) of the program `pol` runs for S rows and P-page
        tables, nothing traced."""
        fn, args, static = self._call(pol, self.batch(pol, S, P))
        return self.compiled.signature(fn, args, static), fn, args, static

    def precompile_policies(self) -> list[CompressPolicy]:
        """Every registered compression press this engine can run, with its default fields (one that needs
        files this model lacks, or a per-slot bias the engine was built without, is left out)."""
        from jaxkv.engine.engine import _resolve_policy
        from jaxkv.policies import POLICIES

        out = []
        for name, cls in POLICIES.items():
            if not issubclass(cls, CompressPolicy):
                continue
            try:
                pol = _resolve_policy(name, None, self.engine.model)
            except (ValueError, OSError):
                continue
            if pol.merge and self.engine.runner.pool.bias is None:
                continue
            out.append(pol)
        return out

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
        tables = self.engine.tables
        compressible = self.heads["compressible"]
        todo, targets = [], []
        for req in reqs:
            req.kv_compressed_at, req.kv_compressed_epoch = len(req.output_ids), req.num_preemptions
            target = pol.target_tokens(len(req.prompt_ids))
            lengths = tables.lengths(req.request_id)
            if compressible.any() and lengths[compressible].max() > target:
                todo.append(req)
                targets.append(target)
        for i in range(0, len(todo), ROW_BUCKETS[-1]):
            self._compress(pol, todo[i:i + ROW_BUCKETS[-1]], targets[i:i + ROW_BUCKETS[-1]])

    def _compress(self, pol: CompressPolicy, todo, targets) -> None:
        eng = self.engine
        tables = eng.tables
        W = pol.window
        S = bucket_for(len(todo), ROW_BUCKETS)
        P = bucket_for(max(tables.max_pages(r.request_id) for r in todo), eng._page_buckets)
        b = self.batch(pol, S, P)
        for row, (req, target) in enumerate(zip(todo, targets)):
            n = req.num_computed  # tokens whose K/V are cached; the last sampled one is not yet
            lo = max(0, n - W)
            ids = req.all_ids[lo:n]
            b["tokens"][row, W - len(ids):] = ids
            b["positions"][row, W - len(ids):] = np.arange(lo, n)
            b["target"][row] = target
            b["recent_from"][row] = n - pol.recent_tokens(target)
        tables.fill_step([r.request_id for r in todo], b["page_table"], b["lengths"])
        pool, counts = self.compiled.call(*self._call(pol, b))
        eng.runner.pool = pool
        counts = np.asarray(counts)
        for row, req in enumerate(todo):
            self.pages_freed += tables.compact(req.request_id, counts[row])
        self.num_compressions += 1
