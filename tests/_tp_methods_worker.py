"""Subprocess half of tests/test_tp_methods.py: KV methods (presses, segment reuse, retrieval) with tensor
parallelism on 2 forced CPU devices against one device. The device count must be fixed before jax starts,
so this runs outside the pytest process.

Usage: _tp_methods_worker.py CKPT PART NAME [NAME ...]; prints one JSON line {name: {"1": run, "2": run}}.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv.cache.head_classes import HeadClass, HeadClassMap  # noqa: E402
from jaxkv.engine.engine import Engine  # noqa: E402
from jaxkv.parallel.mesh import make_mesh  # noqa: E402
from jaxkv.policies import get_policy  # noqa: E402
from jaxkv.policies.reuse import get_reuse_policy  # noqa: E402
from jaxkv.sampling import SamplingParams  # noqa: E402

GREEDY = dict(temperature=0.0, ignore_eos=True)
ENGINE = dict(page_size=4, max_model_len=96, max_num_seqs=4, max_step_tokens=16, enable_prefix_caching=False)


def load(ckpt, tp):
    return jaxkv.load(ckpt, mesh=None if tp == 1 else make_mesh(tp))


def checkpoint_order(engine, lengths):
    """Per-head lengths [L, Hkv] in checkpoint head order (a sharded model's heads are placed)."""
    perm = getattr(engine.model, "kv_head_perm", None)
    if perm is None:
        return np.asarray(lengths)
    out = np.empty_like(lengths)
    for layer in range(lengths.shape[0]):
        out[layer, perm[layer]] = lengths[layer]
    return out


def drive(engine, ids):
    """Steps the engine to the end; -> tokens per request, and each request's per-head lengths (checkpoint
    order) after every step it was alive for."""
    got = {i: [] for i in ids}
    lengths = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
        for rid in ids:
            if rid in engine.tables._seqs:
                lengths[rid].append(checkpoint_order(engine, engine.tables.lengths(rid)).tolist())
    assert engine.allocator.num_free == engine.allocator.num_pages, "pages leaked"
    return [got[i] for i in ids], [lengths[i] for i in ids]


def prompts(cfg, sizes=(40, 27)):
    rng = np.random.default_rng(0)
    return [rng.integers(3, cfg.vocab_size, size=n).tolist() for n in sizes]


# ---- compression presses: each set to evict on a 40-token prompt (16 tokens per head) ---------------------
SMALL = dict(budget=16, window=4, sink=1)
PRESSES = {
    "snapkv": lambda: get_policy("snapkv", **SMALL),
    "adakv": lambda: get_policy("adakv", **SMALL),
    "pyramidkv": lambda: get_policy("pyramidkv", **SMALL),
    "h2o": lambda: get_policy("h2o", budget=16, window=4),
    "rkv": lambda: get_policy("rkv", budget=16, window=4, decode_interval=4),
    "streaming_llm": lambda: get_policy("streaming_llm", budget=16, sink=2, window=4),
    "hardkv": lambda: get_policy("hardkv", budget=16, window=4, p=0.9, lower_fraction=0.1),
    # per-(layer, KV head) temperatures in checkpoint order: each shard must score with its placed heads'
    "hardkv/calibrated": lambda: get_policy("hardkv", budget=16, window=4, p=0.9, lower_fraction=0.1,
                                            calibration=((0.05, 0.4, 1.5, 4.0), (3.0, 0.05, 0.8, 0.2))),
}


def run_press(ckpt, tp, name):
    """`name` engine-wide, or per request (`add_request(kv_policy=...)`) for "NAME/request"."""
    press, per_request = name.removesuffix("/request"), name.endswith("/request")
    policy = PRESSES[press]()
    model = load(ckpt, tp)
    kw = dict(ENGINE, kv_merge=bool(policy.merge))
    engine = Engine(model, **kw) if per_request else Engine(model, kv_policy=policy, **kw)
    sp = SamplingParams(max_tokens=8, **GREEDY)
    ids = [engine.add_request(p, sp, kv_policy=policy if per_request else None)
           for p in prompts(model.config)]
    tokens, lengths = drive(engine, ids)
    return {"tokens": tokens, "lengths": lengths, "freed": engine.compressor.pages_freed}


# ---- segment reuse ---------------------------------------------------------------------------------------
REUSE = {
    "naive": lambda: "naive",
    "sparsex": lambda: get_reuse_policy("sparsex", ratio=0.3, block=2, tail=4),
    "sparsex/per_head": lambda: get_reuse_policy("sparsex", ratio=0.3, block=2, tail=4, per_head=True),
    "cacheblend": lambda: get_reuse_policy("cacheblend", ratio=0.3),
    "epic": lambda: get_reuse_policy("epic", first=3),
    "redknot": lambda: get_reuse_policy("redknot", dense_until=1, recent_n=4, ffn_dilate=1, edge_thresh=0.05),
}


def run_reuse(ckpt, tp, name):
    g, loc = HeadClass.global_(), HeadClass.local(1, 6)
    mixed = HeadClassMap(2, 4, ((g, loc, loc, g), (loc, g, loc, loc)))  # RedKnot's global / local heads
    model = load(ckpt, tp)
    eng = Engine(model, **dict(ENGINE, max_model_len=128), attn_impl="reference",
                 segment_head_classes=mixed if name == "redknot" else None)
    eng.reuser.keep_logits = True
    rng = np.random.default_rng(1)
    pre, s1, s2, suf = (rng.integers(3, model.config.vocab_size, size=n).tolist() for n in (5, 22, 17, 7))
    seg = eng.register_segment(s2, frozen=True)
    rid = eng.add_reuse_request(pre, [s1, seg], suf, reuse=REUSE[name](),
                                sampling=SamplingParams(max_tokens=8, **GREEDY))
    out = []
    while eng.has_unfinished():
        for o in eng.step():
            out += o.new_token_ids if o.request_id == rid else []
    st = eng.reuser.stats[rid]
    return {"tokens": out, "kv_writes": st.kv_writes, "query_rows": st.recomputed_rows,
            "ffn_rows": st.ffn_rows, "promoted": st.promoted_heads,
            "logits": np.asarray(st.first_logits, np.float64).tolist()}


# ---- retrieval (SpeContext: a random retrieval head beside the checkpoint; Quest) -------------------------
RETRIEVAL = {  # name -> (policy, engine-wide, decode steps per call)
    "specontext": (lambda: get_policy("specontext", budget=8), True, 4),
    "specontext/request": (lambda: get_policy("specontext", budget=8), False, 1),
    "quest": (lambda: get_policy("quest", budget=8, dense_layers=1), True, 4),
    "full": (lambda: None, True, 4),
}


def run_retrieval(ckpt, tp, name):
    make, engine_wide, steps = RETRIEVAL[name]
    policy = make()
    model = load(ckpt, tp)
    kw = dict(ENGINE, decode_steps=steps)
    engine = Engine(model, kv_policy=policy, **kw) if engine_wide else Engine(model, **kw)
    sp = SamplingParams(max_tokens=10, **GREEDY)
    ids = [engine.add_request(p, sp, kv_policy=None if engine_wide else policy)
           for p in prompts(model.config, (40, 33))]
    tokens, _ = drive(engine, ids)
    r = engine.retriever.buffers
    return {"tokens": tokens, "steps": r.steps, "selected": r.slots_selected, "new": r.slots_new}


PARTS = {"presses": run_press, "reuse": run_reuse, "retrieval": run_retrieval}


def main():
    ckpt, part, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    run = PARTS[part]
    out = {name: {str(tp): run(ckpt, tp, name) for tp in ((1,) if name == "full" else (1, 2))}
           for name in names}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
