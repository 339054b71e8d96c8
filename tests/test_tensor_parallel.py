"""Tensor parallelism over KV heads (jaxkv/parallel, docs/parallel.md).

The sharded engine runs in a subprocess with 4 forced CPU devices (tests/_tp_worker.py): the device count
must be fixed before jax initialises, and the other tests keep their single device.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.cache.allocator import OutOfPages
from jaxkv.cache.head_classes import HeadClass, HeadClassMap
from jaxkv.models import llama
from jaxkv.parallel.allocator import ShardedPageAllocator
from jaxkv.parallel.mesh import PARAM_AXES, param_specs
from jaxkv.parallel.placement import (
    balanced_permutation,
    contiguous_permutation,
    global_counts,
    permute_head_classes,
    permute_params,
)
from tests.hf_tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Tiny llama with 8 query / 4 KV heads (GQA 2), so TP 1, 2 and 4 all divide the heads."""
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-tp"), num_attention_heads=8,
                                num_key_value_heads=4)


def random_classes(rng, layers, heads, p_global):
    kinds = [HeadClass.global_(), HeadClass.local(4, 64), HeadClass.retrieval(), HeadClass.budget(8, 64)]
    rows = []
    for _ in range(layers):
        row = [kinds[0] if rng.random() < p_global else kinds[int(rng.integers(1, 4))] for _ in range(heads)]
        rows.append(tuple(row))
    return HeadClassMap(layers, heads, tuple(rows))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_balanced_placement_spreads_every_kind(tp):
    rng = np.random.default_rng(tp)
    for p_global in (0.1, 0.3, 0.7):
        hc = random_classes(rng, 12, 8, p_global)
        perm = balanced_permutation(hc, tp)
        assert (np.sort(perm, axis=1) == np.arange(8)).all()  # a permutation per layer
        for kind in ("global", "local", "retrieval", "budget"):
            counts = global_counts(hc, perm, tp, kind)
            assert (counts.max(1) - counts.min(1) <= 1).all(), (kind, counts)
        placed = permute_head_classes(hc, perm)
        assert (placed.kinds() == np.take_along_axis(hc.kinds(), perm, axis=1)).all()


def test_contiguous_placement_can_be_unbalanced():
    g, loc = HeadClass.global_(), HeadClass.local(4, 64)
    hc = HeadClassMap(1, 8, ((g, g, g, g, loc, loc, loc, loc),))
    assert global_counts(hc, contiguous_permutation(1, 8), 4).tolist() == [[2, 2, 0, 0]]
    assert global_counts(hc, balanced_permutation(hc, 4), 4).tolist() == [[1, 1, 1, 1]]


def test_permuted_model_output_equals_unpermuted(ckpt):
    model = jaxkv.load(ckpt)
    cfg = model.config
    rng = np.random.default_rng(0)
    perm = np.stack([rng.permutation(cfg.num_kv_heads) for _ in range(cfg.num_layers)]).astype(np.int32)
    assert (perm != np.arange(cfg.num_kv_heads)).any()
    host = jax.tree.map(np.asarray, model.params)
    permuted = permute_params(host, cfg, perm)
    assert not np.array_equal(permuted["layers"][0]["wk"], host["layers"][0]["wk"]) or \
        not np.array_equal(permuted["layers"][1]["wk"], host["layers"][1]["wk"])
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(2, 12)), jnp.int32)
    want = llama.dense_logits(model.params, cfg, tokens)
    got = llama.dense_logits(jax.tree.map(jnp.asarray, permuted), cfg, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # A permutation that splits a GQA group from its KV head would change the output.
    broken = dict(permuted, layers=[dict(permuted["layers"][0], wq=host["layers"][0]["wq"])]
                  + permuted["layers"][1:])
    if (perm[0] != np.arange(cfg.num_kv_heads)).any():
        bad = llama.dense_logits(jax.tree.map(jnp.asarray, broken), cfg, tokens)
        assert np.abs(np.asarray(bad) - np.asarray(want)).max() > 1e-3


def test_param_table_covers_every_parameter(ckpt):
    cfg = jaxkv.load(ckpt).config
    shapes = llama.param_shapes(cfg)
    names = {k for k in shapes if k != "layers"} | set(shapes["layers"][0])
    assert names <= set(PARAM_AXES)
    params = llama.init_params(cfg, jax.random.PRNGKey(0))
    specs = param_specs(params, cfg, 4)
    assert tuple(specs["layers"][0]["wq"]) == (None, "tp")
    assert tuple(specs["layers"][0]["wo"]) == ("tp", None)
    assert tuple(specs["layers"][0]["w_down"]) == ("tp", None)
    assert tuple(specs["embed"]) == (None, None)


def test_sharded_allocator_keeps_heads_in_their_shard():
    a = ShardedPageAllocator(16, 4, 8)  # 4 pages per shard, 2 heads per shard
    heads = np.array([0, 1, 2, 7, 7, 3])
    ids = a.allocate(6, heads=heads)
    assert (ids // 4 == heads // 2).tolist() == [True] * 6
    assert a.num_free == 10 and a.num_free_per_shard() == [2, 2, 4, 2]
    with pytest.raises(OutOfPages):
        a.allocate(3, heads=[6, 6, 7])  # shard 3 has 2 left; nothing is taken
    assert a.num_free == 10
    a.incref(ids[:1])
    a.decref(ids)
    assert a.num_free == 15 and a.refcount(ids[:1]).tolist() == [1]
    a.free(ids[:1])
    assert a.num_free == 16
    with pytest.raises(ValueError):
        a.allocate(1)  # the head of every page is required


def test_sharded_allocator_admission_follows_the_observed_split():
    a = ShardedPageAllocator(40, 2, 4)  # 20 pages per shard, heads 0-1 on shard 0
    a.allocate(12, heads=[0] * 9 + [2] * 3)  # a 3:1 split: shard 0 has 11 free, shard 1 17
    assert a.num_free == 28
    assert a.can_allocate(12)  # ~ 9 + 3 more fit
    assert not a.can_allocate(20)  # ~ 15 on shard 0 do not, although 28 pages are free in total


def test_tp_greedy_tokens_identical_across_tp_1_2_4(ckpt):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_tp_worker.py"), str(ckpt)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("dense_logits_maxdiff") < 1e-4  # placed, sharded weights: the same dense logits
    for name, runs in out.items():
        ref = runs["1"]["tokens"]
        assert all(len(t) == 10 for t in ref)
        for tp in ("2", "4"):
            assert runs[tp]["tokens"] == ref, (name, tp)
            assert runs[tp]["all_freed"] and runs[tp]["in_range"] and runs[tp]["pool_sharded"], (name, tp)
    assert out["pallas_mixed"]["4"]["fresh"]  # the head_class_prefill path ran per shard


@pytest.mark.slow
def test_multiprocess_tp_over_jax_distributed_matches_one_device():
    """2 processes x 2 CPU devices through jax.distributed (gloo): a TP 4 mesh over both processes gives
    the one-device greedy tokens (`python -m benchmarks.tp_multiprocess`; on GPU one process per GPU)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "benchmarks.tp_multiprocess", "--num-processes", "2", "--cpu-devices", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 processes, 4 devices" in proc.stdout and "equal to one device: True" in proc.stdout
