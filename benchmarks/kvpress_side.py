"""The kvpress side of `python -m benchmarks.kvpress`: torch + transformers + kvpress only (no jaxkv import).

Runs in its own virtual environment, because kvpress pins ``transformers<5.3`` and the project's venv has a
newer one (see docs/eval.md, "kvpress peer oracle", for the setup). Reads a JSON request on stdin and writes
a JSON answer on stdout; the token ids come from the caller, so both sides see exactly the same inputs.

Request::

    {"model": DIR, "threads": 1, "device": "auto" | "cpu" | "cuda", "mode": "kept" | "generate",
     "presses": [{"label": "snapkv", "press": "SnapKVPress", "kwargs": {...},
                  "wrap": null | {"press": "AdaKVPress", "kwargs": {"alpha_safeguard": 0.2}}}],
     "prompts": [{"ids": [...], "max_new": 16}], "stop_ids": [2, 7]}

``kept``: one prefill per (press, prompt) under ``press(model)``; per layer, the scores the press computed
(``score`` hooked) and the kept positions per KV head, recovered from the press's own output: a
`ScorerPress` / `PyramidKVPress` gathers the kept keys (matched back to their rows), `AdaKVPress` masks
``module.masked_key_indices`` (kept = the rest). ``generate``: the prompt prefilled under the press (the
first token from the prefill logits, as our engine does), then greedy decoding over the compressed cache
with positions continuing from the prompt length (kvpress's own ``generate_answer`` loop).
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Run as a script, this file's directory leads sys.path, and its neighbour benchmarks/kvpress.py would shadow
# the kvpress package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

_MISSING = None
try:
    import kvpress
    import torch
    from transformers import DynamicCache, LlamaForCausalLM
except ImportError as e:  # --help works anywhere; a run needs the kvpress venv
    _MISSING = e


EAGER_PRESSES = ("ObservedAttentionPress",)  # score with the attention weights, which sdpa does not return


def make_press(spec):
    press = getattr(kvpress, spec["press"])(**spec.get("kwargs", {}))
    if spec.get("wrap"):
        press = getattr(kvpress, spec["wrap"]["press"])(press=press, **spec["wrap"].get("kwargs", {}))
    return press


def _rows_of(keys_in, keys_out):
    """Positions of the rows of keys_out [H, n, D] in keys_in [H, N, D] (gathered copies: exact matches)."""
    out = []
    for h in range(keys_in.shape[0]):
        eq = (keys_out[h][:, None, :] == keys_in[h][None, :, :]).all(-1)  # [n, N]
        assert bool(eq.any(-1).all()), "kept key not found among the inputs"
        out.append(sorted(int(i) for i in eq.float().argmax(-1)))
    return out


def capture(press, n_layers):
    """Hooks `score` and `compress` of the press; returns the record dict filled during a prefill."""
    rec = {"scores": [None] * n_layers, "kept": [None] * n_layers}
    scorer = press.press if isinstance(press, kvpress.AdaKVPress) else press
    orig_score, orig_compress = scorer.score, press.compress

    def score(module, *a, **k):
        s = orig_score(module, *a, **k)
        rec["scores"][module.layer_idx] = s[0].detach().float().clone()
        return s

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        k_out, v_out = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
        if isinstance(press, kvpress.AdaKVPress):
            n = keys.shape[2]
            keep = torch.ones(keys.shape[1], n, dtype=torch.bool, device=keys.device)
            _, heads, seqs = module.masked_key_indices
            keep[heads, seqs] = False
            rec["kept"][module.layer_idx] = [torch.nonzero(k).flatten().tolist() for k in keep]
        else:
            rec["kept"][module.layer_idx] = _rows_of(keys[0], k_out[0])
        return k_out, v_out

    scorer.score, press.compress = score, compress
    return rec


def run_kept(model, spec, ids):
    press = make_press(spec)
    rec = capture(press, model.config.num_hidden_layers)
    with torch.no_grad(), press(model):
        model.model(input_ids=torch.tensor([ids], device=model.device), past_key_values=DynamicCache())
    return {"kept": rec["kept"],
            "scores": [s.tolist() if s is not None else None for s in rec["scores"]]}


def run_generate(model, spec, ids, max_new, stop_ids):
    press = make_press(spec) if spec else None
    cache = DynamicCache()
    dev = model.device
    t0 = time.perf_counter()
    with torch.no_grad():
        if press is not None:
            with press(model):
                out = model(input_ids=torch.tensor([ids], device=dev), past_key_values=cache,
                            logits_to_keep=1)
        else:
            out = model(input_ids=torch.tensor([ids], device=dev), past_key_values=cache, logits_to_keep=1)
        held = [cache.get_seq_length(i) for i in range(len(cache))]
        toks = [int(out.logits[0, -1].argmax())]
        pos = len(ids)
        while len(toks) < max_new and toks[-1] not in stop_ids:
            out = model(input_ids=torch.tensor([[toks[-1]]], device=dev), past_key_values=cache,
                        position_ids=torch.tensor([[pos]], device=dev))
            pos += 1
            toks.append(int(out.logits[0, -1].argmax()))
    return {"tokens": toks, "cache_lengths": held, "seconds": time.perf_counter() - t0}


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.kvpress_side", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args(argv)
    if _MISSING is not None:
        raise SystemExit(f"kvpress side: {_MISSING}; run it with the python of a venv that has kvpress "
                         "(benchmarks/setup_kvpress_venv.sh)")
    req = json.load(sys.stdin)
    torch.set_num_threads(int(req.get("threads", 1)))
    device = req.get("device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 as float32, as our side computes it
    torch.backends.cudnn.allow_tf32 = False
    models = {}

    def model_for(spec):
        """sdpa, except for presses that read the attention weights (eager; loaded when first needed)."""
        impl = "eager" if spec and spec["press"] in EAGER_PRESSES else "sdpa"
        if impl not in models:
            dtype = getattr(torch, req.get("dtype", "float32"))
            models[impl] = LlamaForCausalLM.from_pretrained(req["model"], dtype=dtype,
                                                            attn_implementation=impl).to(device).eval()
        return models[impl]

    res = {"kvpress_version": getattr(kvpress, "__version__", None), "torch": torch.__version__,
           "device": device,
           "results": []}
    import transformers

    res["transformers"] = transformers.__version__
    for spec in req["presses"]:
        model = model_for(spec)
        rows = []
        for p in req["prompts"]:
            if req["mode"] == "kept":
                rows.append(run_kept(model, spec, p["ids"]))
            else:
                rows.append(run_generate(model, spec, p["ids"], p["max_new"], set(req["stop_ids"])))
        res["results"].append({"label": spec["label"] if spec else "full", "rows": rows})
    json.dump(res, sys.stdout)


if __name__ == "__main__":
    main()
