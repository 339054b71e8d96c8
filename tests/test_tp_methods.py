"""KV methods under tensor parallelism (docs/parallel.md, "KV methods per shard"): compression presses,
segment reuse and SpeContext / Quest retrieval on 2 forced CPU devices give the one-device greedy tokens.

Each case runs in a subprocess (tests/_tp_methods_worker.py; the device count is fixed before jax starts)
on a tiny GQA llama (4 KV heads, random weights, so heads differ). The configurations make every method
act: the presses evict (16 of 40 tokens per head), the reuse methods recompute a strict subset, the
retrieval budget (8 slots per head) is below the context. Besides tokens, the per-head lengths after
compression (AdaKV's differ per head), the reuse statistics and first-token logits, and the retrieval
selection counts must match: a shard deciding from its own heads alone, or from heads in the wrong order,
changes them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.hf_tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Tiny llama, 8 query / 4 KV heads (GQA 2), 2 layers, with a random SpeContext retrieval head (tap 1)."""
    import jax

    import jaxkv
    from jaxkv.policies.retrieve import specontext as sc

    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-tp-methods"), num_attention_heads=8,
                                num_key_value_heads=4)
    model = jaxkv.load(path)
    head = sc.init_head(sc.HeadConfig.for_model(model.config, tap_layer=1, model_id=model.model_id),
                        jax.random.PRNGKey(3), scale=0.5)
    sc.save_head(Path(path) / sc.HEAD_DIR, head, {"test": True})
    return path


def run_worker(ckpt, part, names):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_tp_methods_worker.py"), str(ckpt), part,
                           *names], capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_presses(out):
    for name, runs in out.items():
        one, two = runs["1"], runs["2"]
        assert one["freed"] > 0, name  # the press evicted
        assert two["tokens"] == one["tokens"], name
        assert two["lengths"] == one["lengths"], name  # every head kept the same count
        assert two["freed"] == one["freed"], name


PRESSES_QUICK = ["snapkv", "snapkv/request", "adakv", "hardkv/calibrated"]
PRESSES_REST = ["pyramidkv", "h2o", "rkv", "streaming_llm", "hardkv"]


def test_tp_presses_match_one_device(ckpt):
    """SnapKV engine-wide and per request, AdaKV (counts from a top-k over every head of a layer), HARD-KV
    with per-head calibrated temperatures (sliced per shard, in placed order)."""
    out = run_worker(ckpt, "presses", PRESSES_QUICK)
    check_presses(out)
    final = np.array(out["adakv"]["1"]["lengths"][0][-1])  # AdaKV's heads keep different counts
    assert len(np.unique(final)) > 1


@pytest.mark.slow
def test_tp_every_other_press_matches_one_device(ckpt):
    from jaxkv.policies import POLICIES
    from jaxkv.policies.base import CompressPolicy

    presses = {n for n, c in POLICIES.items() if isinstance(c, type) and issubclass(c, CompressPolicy)}
    assert presses == {p.split("/")[0] for p in PRESSES_QUICK + PRESSES_REST}  # the whole registry
    check_presses(run_worker(ckpt, "presses", PRESSES_REST))


def check_reuse(out):
    for name, runs in out.items():
        one, two = runs["1"], runs["2"]
        assert two["tokens"] == one["tokens"], name
        for stat in ("kv_writes", "query_rows", "promoted"):
            assert two[stat] == one[stat], (name, stat)
        # rows whose probe mass sits on RedKnot's threshold may flip with the summation order
        assert np.abs(np.subtract(two["ffn_rows"], one["ffn_rows"])).max() <= 1, name
        np.testing.assert_allclose(two["logits"], one["logits"], atol=1e-4, err_msg=name)


def test_tp_reuse_matches_one_device(ckpt):
    """naive; SparseX (token scores summed over every shard's heads, top-k on all of them); RedKnot (global
    / local heads from a head-class map, edge-mass promotion per head, FFN rows from every head's probe
    mass)."""
    out = run_worker(ckpt, "reuse", ["naive", "sparsex", "redknot"])
    check_reuse(out)
    rows = out["sparsex"]["1"]["query_rows"]
    assert rows[1] < rows[0]  # SparseX's sparse layer recomputed a subset
    assert sum(out["redknot"]["1"]["promoted"]) > 0  # RedKnot promoted local heads


@pytest.mark.slow
def test_tp_other_reuse_methods_match_one_device(ckpt):
    check_reuse(run_worker(ckpt, "reuse", ["sparsex/per_head", "cacheblend", "epic"]))


def test_tp_retrieval_matches_one_device(ckpt):
    """SpeContext engine-wide (4 decode steps a call) and per request (1), Quest (per-page key bounds split
    with the pool): the tokens, the number of selected slots and of slots new to a step's selection."""
    out = run_worker(ckpt, "retrieval", ["specontext", "specontext/request", "quest", "full"])
    full = out.pop("full")["1"]["tokens"]
    for name, runs in out.items():
        one, two = runs["1"], runs["2"]
        assert one["tokens"] != full, name  # the selection changed the answer: it was read
        assert two["tokens"] == one["tokens"], name
        counts = ("steps", "selected", "new")
        assert [two[c] for c in counts] == [one[c] for c in counts], name
    assert out["specontext"]["1"]["selected"] > 0


def test_retrieval_head_follows_the_placed_kv_heads(ckpt):
    """The SpeContext head's keys for placed KV head j are the checkpoint head perm[j]'s (K columns and the
    GQA group's Q columns move together); a placement that differs between the layers the selection serves
    is refused with a clear error."""
    import jax
    import jax.numpy as jnp

    from jaxkv.parallel.methods import placed_retrieval_head
    from jaxkv.policies.retrieve import specontext as sc

    head = sc.load_head(Path(ckpt) / sc.HEAD_DIR)
    c = head.config
    perm = np.array([[0, 1, 2, 3], [2, 0, 3, 1]])  # layer 1 (the tap on) differs from identity
    placed = placed_retrieval_head(head, perm, first_layer=1)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 5, c.hidden_size))
    pos = jnp.arange(5)[None]
    q0, k0 = sc.head_qk(head, x, pos)
    q1, k1 = sc.head_qk(placed, x, pos)
    np.testing.assert_allclose(np.asarray(k1), np.asarray(k0)[:, :, perm[1]], rtol=1e-6)
    g = c.num_heads // c.num_kv_heads
    groups = np.concatenate([np.arange(h * g, (h + 1) * g) for h in perm[1]])
    np.testing.assert_allclose(np.asarray(q1), np.asarray(q0)[:, :, groups], rtol=1e-6)
    with pytest.raises(ValueError, match="placement"):
        placed_retrieval_head(head, perm, first_layer=0)
