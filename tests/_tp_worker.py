"""Subprocess half of tests/test_tensor_parallel.py: needs 4 CPU devices, which must be set before jax
initialises (so it cannot run inside the pytest process). Prints one JSON line with the results."""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv.cache.head_classes import HeadClass, HeadClassMap  # noqa: E402
from jaxkv.engine.engine import Engine  # noqa: E402
from jaxkv.parallel.mesh import make_mesh  # noqa: E402
from jaxkv.sampling import SamplingParams  # noqa: E402


def run(ckpt, tp, impl, hc):
    model = jaxkv.load(ckpt, mesh=None if tp == 1 else make_mesh(tp), head_classes=hc)
    engine = Engine(model, page_size=4, max_model_len=64, max_num_seqs=4, max_step_tokens=16,
                    enable_prefix_caching=False, head_classes=hc, attn_impl=impl)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.config.vocab_size, size=n).tolist() for n in (5, 30, 11)]
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
           for p in prompts]
    got = {i: [] for i in ids}
    in_range = True
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
        if tp > 1:  # every page of KV head h lies in the range of the shard that owns h
            a = engine.allocator
            for rid in ids:
                if rid in engine.tables._seqs:
                    for heads in engine.tables.page_lists(rid):
                        for h, pages in enumerate(heads):
                            in_range &= bool((pages // a.pages_per_shard == h // a.heads_per_shard).all())
    sharded = tp == 1 or engine.runner.pool.k.sharding.shard_shape(engine.runner.pool.k.shape)[0] == \
        engine.runner.pool.k.shape[0] // tp
    freed = engine.allocator.num_free == engine.allocator.num_pages
    return {"tokens": [got[i] for i in ids], "all_freed": freed,
            "in_range": in_range, "pool_sharded": bool(sharded),
            "fresh": engine.scheduler.max_fresh_tokens > 0}


def main():
    ckpt = sys.argv[1]
    g, loc = HeadClass.global_(), HeadClass.local(2, 6)
    mixed = HeadClassMap(2, 4, ((g, g, loc, loc), (loc, g, loc, g)))
    out = {}
    tokens = [5, 6, 7, 8, 9, 10, 11]
    dense = jaxkv.load(ckpt).logits(tokens)
    placed = jaxkv.load(ckpt, mesh=make_mesh(4), head_classes=mixed)  # permuted + sharded weights
    out["dense_logits_maxdiff"] = float(np.abs(placed.logits(tokens) - dense).max())
    for name, impl, hc in (("jnp", None, None), ("pallas_mixed", "pallas", mixed)):
        out[name] = {tp: run(ckpt, tp, impl, hc) for tp in (1, 2, 4)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
