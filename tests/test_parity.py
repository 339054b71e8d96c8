"""Logit and greedy-generation parity with Hugging Face transformers (fp32, CPU) for every family.

Run with `-s` to print the measured max relative errors (recorded in docs/models.md).
"""

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_tiny import FAMILIES, make_tiny_checkpoint  # noqa: E402

import jaxkv  # noqa: E402

TOL = 1e-4  # max |jaxkv - hf| / max |hf|
SEQ = 40  # longer than the Mistral / Qwen2 windows (8)

torch.set_num_threads(1)


def _rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model, model(torch.tensor(ids)).logits.numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    return {f: make_tiny_checkpoint(f, root / f, seed=1) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_match_transformers(checkpoints, family):
    path = checkpoints[family]
    model = jaxkv.load(path)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, SEQ))
    hf_model, ref = _hf_logits(path, ids)
    err = _rel_err(model.logits(ids), ref)
    print(f"\nparity {family}: max rel logit error {err:.2e} (T={SEQ}, windows={model.config.layer_windows})")
    assert err <= TOL

    # Greedy: HF generate (its KV / sliding-window cache path) vs argmax of re-run dense logits. The
    # sequence is padded to its final length once, so one compilation serves every step (causal).
    prompt, new = list(ids[0, :12]), 32
    hf_model.generation_config.eos_token_id = None  # always 32 tokens
    with torch.no_grad():
        hf_out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    seq = np.zeros(len(prompt) + new, np.int32)
    seq[: len(prompt)] = prompt
    for t in range(len(prompt), len(seq)):
        seq[t] = int(np.argmax(model.logits(seq)[0, t - 1]))
    assert seq[len(prompt) :].tolist() == hf_out


def _random_overrides(family: str, rng: np.random.Generator) -> dict:
    kv = int(rng.integers(1, 4))
    heads = kv * int(rng.integers(1, 4))
    head_dim = int(rng.choice([8, 12, 16, 32]))
    layers = int(rng.integers(1, 4))
    o = dict(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=int(rng.choice([48, 80, 128])),
        tie_word_embeddings=bool(rng.integers(2)),
        rope_theta=float(rng.choice([1e4, 5e5, 1e6])),
        vocab_size=int(rng.choice([320, 384])),
        rms_norm_eps=float(rng.choice([1e-6, 1e-5])),
    )
    if family == "qwen2":  # no head_dim field: hidden = heads * head_dim
        o["hidden_size"] = heads * head_dim
    elif family == "qwen3":  # head_dim independent of hidden / heads
        o.update(hidden_size=int(rng.choice([32, 48, 64])), head_dim=head_dim)
    else:  # transformers requires hidden % heads == 0 here, head_dim may still differ
        o.update(hidden_size=heads * int(rng.choice([8, 16])), head_dim=head_dim)
    if family == "llama":
        low = float(rng.choice([1.0, 2.0]))
        o["attention_bias"] = bool(rng.integers(2))
        o["rope_scaling"] = (
            None
            if rng.integers(4) == 0
            else {
                "rope_type": "llama3",
                "factor": float(rng.uniform(2, 32)),
                "low_freq_factor": low,
                "high_freq_factor": low + float(rng.choice([1.0, 3.0])),
                "original_max_position_embeddings": int(rng.choice([8, 16, 32, 64])),
            }
        )
    if family == "mistral":
        o["sliding_window"] = None if rng.integers(4) == 0 else int(rng.integers(2, 20))
    if family in ("qwen2", "qwen3"):
        use = bool(rng.integers(2))
        o.update(use_sliding_window=use, sliding_window=int(rng.integers(2, 20)))
        if use and rng.integers(2):
            o["layer_types"] = [
                str(rng.choice(["full_attention", "sliding_attention"])) for _ in range(layers)
            ]
        else:
            o["max_window_layers"] = int(rng.integers(0, layers + 1))
    if family == "qwen3":
        o["attention_bias"] = bool(rng.integers(2))
    return o


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_random_config_parity(tmp_path, family, seed):
    rng = np.random.default_rng(1000 * seed + FAMILIES.index(family))
    overrides = _random_overrides(family, rng)
    path = make_tiny_checkpoint(family, tmp_path / "ckpt", seed=seed, **overrides)
    model = jaxkv.load(path)
    ids = rng.integers(0, model.config.vocab_size, (2, 24))
    _, ref = _hf_logits(path, ids)
    err = _rel_err(model.logits(ids), ref)
    print(f"\nrandom parity {family} seed={seed}: {err:.2e} {overrides}")
    assert err <= TOL, overrides


def test_forward_flattened_ragged_batch_matches_dense():
    """The paged path's calling convention: B = 1, two sequences flattened along T, absolute positions."""
    import jax
    import jax.numpy as jnp

    from jaxkv.config import ModelConfig
    from jaxkv.models import llama
    from jaxkv.models.attention import dense_attention

    cfg = ModelConfig(
        family="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        layer_windows=(0, 5),
        qk_norm=True,
        qkv_bias=True,
        o_bias=True,
    )
    params = llama.init_params(cfg, jax.random.key(0), scale=0.2)
    a, b = np.arange(10) % 64, (np.arange(7) * 5 + 3) % 64
    tokens = jnp.asarray(np.concatenate([a, b])[None], jnp.int32)
    offset = 1000  # RoPE and windows are relative: shifting every position changes nothing
    positions = jnp.asarray(np.concatenate([np.arange(10), np.arange(7)])[None] + offset, jnp.int32)

    def attend(layer, q, k, v, state):
        outs = [
            dense_attention(
                q[:, s], k[:, s], v[:, s], positions[:, s], positions[:, s],
                window=jnp.asarray(cfg.layer_windows)[layer]  # `layer` is traced under the layer scan
            )
            for s in (slice(0, 10), slice(10, 17))
        ]
        return jnp.concatenate(outs, axis=1), state + 1

    hidden, calls = llama.forward(params, cfg, tokens, positions, attend, 0)
    assert calls == cfg.num_layers
    got = np.asarray(llama.lm_head(params, cfg, hidden))[0]
    for want, s in (
        (llama.dense_logits(params, cfg, tokens[:, :10]), slice(0, 10)),
        (llama.dense_logits(params, cfg, tokens[:, 10:]), slice(10, 17)),
    ):
        want = np.asarray(want)[0]
        assert _rel_err(got[s], want) < 1e-4


def test_stacked_layers_run_under_scan_and_match_the_list():
    """`llama.stack_layers` params take the `lax.scan` branch of the layer loop; logits equal the unrolled
    loop's over per-layer buffers (a per-layer window included, indexed by the traced layer)."""
    import jax
    import jax.numpy as jnp

    from jaxkv.config import ModelConfig
    from jaxkv.models import llama

    cfg = ModelConfig(family="mistral", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=8, layer_windows=(0, 4, 0))
    params = llama.init_params(cfg, jax.random.key(1), scale=0.2)
    stacked = llama.stack_layers(params)
    assert stacked["layers"]["wq"].shape[0] == 3 and isinstance(params["layers"], list)
    tokens = jnp.asarray((np.arange(12) * 7 % 64)[None], jnp.int32)
    want = np.asarray(llama.dense_logits(params, cfg, tokens))
    got = np.asarray(jax.jit(llama.dense_logits, static_argnums=1)(stacked, cfg, tokens))
    assert _rel_err(got, want) < 1e-5
    assert _rel_err(got, np.asarray(llama.dense_logits({**params, "layers": params["layers"][::-1]},
                                                       cfg, tokens))) > 1e-3  # the layer order matters


def test_shared_layers_trace_one_layer_body_and_match_the_list():
    """`SharedLayers` run one jitted layer body: the lowered program holds one private layer function called
    once per layer (tracing and lowering cost one layer), and the logits equal the unrolled loop's."""
    import jax
    import jax.numpy as jnp

    from jaxkv.config import ModelConfig
    from jaxkv.models import llama

    cfg = ModelConfig(family="mistral", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=5,
                      num_heads=4, num_kv_heads=2, head_dim=8, layer_windows=(0, 4, 0, 4, 0))
    params = llama.init_params(cfg, jax.random.key(2), scale=0.2)
    shared = llama.share_layers(params)
    assert isinstance(shared["layers"], llama.SharedLayers) and len(shared["layers"]) == 5
    tokens = jnp.asarray((np.arange(12) * 5 % 64)[None], jnp.int32)
    logits = jax.jit(llama.dense_logits, static_argnums=1)
    want = np.asarray(logits(params, cfg, tokens))
    assert _rel_err(np.asarray(logits(shared, cfg, tokens)), want) < 1e-5
    text = logits.lower(shared, cfg, tokens).as_text()
    # one body, plus at most one copy for the last layer when its unused outputs are pruned
    assert len(re.findall(r"call @layer(_\d+)?\(", text)) == cfg.num_layers
    assert 1 <= len(re.findall(r"func\.func private @layer(_\d+)?\(", text)) <= 2
    unrolled = logits.lower(params, cfg, tokens).as_text()
    assert "@layer" not in unrolled and len(unrolled) > 2 * len(text)


def test_engine_layer_loops_give_the_same_tokens(tmp_path):
    """The engine's three layer loops (unrolled, shared body, scan) produce the same greedy tokens."""
    from jaxkv.engine.engine import Engine
    from jaxkv.models import llama
    from jaxkv.sampling import SamplingParams

    model = jaxkv.load(make_tiny_checkpoint("llama", tmp_path / "ckpt"))
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[3, 9, 27, 81 % 50, 17], list(range(5, 40))]
    out = {}
    for loop in ("unrolled", "shared", "scan"):
        eng = Engine(model, num_pages=256, page_size=4, max_model_len=64, max_num_seqs=2, max_step_tokens=16,
                     layer_loop=loop)
        form = eng.model.params["layers"]
        assert {"unrolled": type(form) is list, "shared": isinstance(form, llama.SharedLayers),
                "scan": isinstance(form, dict)}[loop]
        ids = [eng.add_request(p, sp) for p in prompts]
        toks = {i: [] for i in ids}
        while eng.has_unfinished():
            for o in eng.step():
                toks[o.request_id] += o.new_token_ids
        out[loop] = [toks[i] for i in ids]
    assert out["unrolled"] == out["shared"] == out["scan"] and all(len(t) == 6 for t in out["shared"])
    with pytest.raises(ValueError, match="layer_loop"):
        Engine(model, num_pages=64, page_size=4, max_model_len=64, layer_loop="rolled")
