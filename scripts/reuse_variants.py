"""Distinct compiled reuse passes over a stream of 24 varied RAG layouts: the embedded model, 12 frozen
segments of 100-700 tokens, 2-5 per request, questions of 8-60 tokens (docs/policies.md, "Buckets").

    python scripts/reuse_variants.py redknot      # or sparsex, cacheblend, naive, ...
"""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxkv  # noqa: E402
from jaxkv.cache.head_classes import all_global  # noqa: E402
from jaxkv.engine.engine import Engine  # noqa: E402
from jaxkv.policies.reuse.apply import num_compilations  # noqa: E402
from jaxkv.sampling import SamplingParams  # noqa: E402

method = sys.argv[1] if len(sys.argv) > 1 else "redknot"
model = jaxkv.load("jaxkv/assets/default_model")
cfg = model.config
eng = Engine(model, page_size=16, max_model_len=4096, enable_prefix_caching=False,
             head_classes=all_global(cfg.num_layers, cfg.num_kv_heads))
rng = np.random.default_rng(0)
docs = [eng.register_segment(rng.integers(10, cfg.vocab_size, int(n)).tolist(), frozen=True)
        for n in rng.integers(100, 700, 12)]
sp = SamplingParams(temperature=0.0, max_tokens=1)
t0 = time.perf_counter()
for _ in range(24):
    k = int(rng.integers(2, 6))
    segs = [docs[j] for j in rng.choice(len(docs), k, replace=False)]
    q = rng.integers(10, cfg.vocab_size, int(rng.integers(8, 60))).tolist()
    eng.add_reuse_request([1], segs, q, reuse=method, sampling=sp)
    while eng.has_unfinished():
        eng.step()
print(f"{method}: 24 requests, {num_compilations()} compiled reuse passes, "
      f"{time.perf_counter() - t0:.0f} s")
