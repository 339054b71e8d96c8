"""End-to-end engine benchmark against Hugging Face transformers on the same device and the same weights.

Builds a random-weight Llama checkpoint with transformers (`LlamaForCausalLM(config).save_pretrained`), loads
it with `jaxkv.load` and with transformers (sdpa), and runs these workloads on both in one
invocation: batched decode, time to first token, single-stream decode, head-class vs all-global serving
and fp32 greedy agreement. Every row also gets its bytes / FLOPs floor (weights + KV bytes at the copy
bandwidth, matmul FLOPs at the bf16 rate). jaxkv rows use a fresh engine per timed run, prefix caching off,
greedy with EOS ignored, and time the second run (the first compiles).

    python -m benchmarks.e2e --out results.md          # GPU: 1B shape, every row
    python -m benchmarks.e2e --shapes 1b,8b                    # plus the 8B shape
    python -m benchmarks.e2e --small                           # CPU smoke mode (tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import (
    COPY_BW,
    MATMUL_RATE,
    SHAPES,
    SINK,
    WINDOW,
    command_line,
    describe_device,
    head_class_map,
    make_checkpoint,
    markdown_table,
    write_json,
    write_section,
)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    prompt: int
    new: int
    max_step_tokens: int
    head_classes: str = "global"  # "global" | "1of8" (KV head 0 of every layer global, rest sink + window)
    hf: bool = True


def workloads(small: bool) -> list[Workload]:
    if small:
        return [Workload("batch", 4, 32, 8, 64), Workload("ttft", 1, 64, 1, 64),
                Workload("single", 1, 64, 8, 64), Workload("headclass", 2, 96, 8, 32, "1of8", hf=False),
                Workload("headclass-allglobal", 2, 96, 8, 32, "global", hf=False)]
    return [Workload("batch", 32, 1024, 256, 8192), Workload("ttft", 1, 8192, 1, 8192),
            Workload("ttft", 1, 32768, 1, 8192), Workload("single", 1, 8192, 128, 8192),
            Workload("short", 128, 256, 128, 8192, hf=False),
            Workload("headclass", 16, 16384, 512, 512, "1of8", hf=False),
            Workload("headclass-allglobal", 16, 16384, 512, 512, "global", hf=False)]


# ------------------------------------------------------------------------------------------------ floors

def floors(w: Workload, cfg, dtype_bytes: int) -> dict:
    """Bytes floor of one decode step (weights + KV read once) and FLOPs floor of the prefill."""
    h, inter, L, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.head_dim
    hq, hkv, vocab = cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size
    layer_params = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * inter
    weights = (L * layer_params + h * vocab) * dtype_bytes  # lm_head read every step; embed is a gather
    kv_token_head = 2 * d * dtype_bytes  # K + V of one token of one (layer, KV head)
    frac_global = 1.0 / hkv if w.head_classes == "1of8" else 1.0

    def kv_slots(ctx):  # per (layer, head) slots a decode step must read, averaged over heads
        return frac_global * ctx + (1 - frac_global) * min(ctx, SINK + WINDOW)

    mean_ctx = w.prompt + w.new / 2
    step_bytes = weights + w.batch * L * hkv * kv_slots(mean_ctx) * kv_token_head
    step_s = step_bytes / COPY_BW
    lin = 2 * L * layer_params * w.prompt * w.batch + 2 * h * vocab * w.batch
    local_keys = (1 - frac_global) * min(w.prompt, SINK + WINDOW) * w.prompt
    attn = 2 * 2 * L * hq * d * w.batch * (frac_global * w.prompt * w.prompt / 2 + local_keys)
    prefill_s = (lin + attn) / MATMUL_RATE
    return {"step_s": step_s, "prefill_s": prefill_s, "total_s": prefill_s + (w.new - 1) * step_s}


# ------------------------------------------------------------------------------------------------- jaxkv

def run_jaxkv(model, w: Workload, prompts, *, page_size: int, kv_cache_bytes: int, engine_kwargs=None,
              sampling=None):
    """Fresh engine; returns (total s, ttft s, tokens per prompt, decode step s). The decode step is timed
    from the moment every request has its first token (all prefills done) to the end, per decode step
    (tokens produced in that time / batch): the per-step cost the bytes floor describes, without the
    prefills of requests admitted after the first."""
    from jaxkv.engine.engine import Engine
    from jaxkv.sampling import SamplingParams

    cfg = model.config
    options = dict(page_size=page_size, max_num_seqs=w.batch, max_model_len=w.prompt + w.new,
                   max_step_tokens=w.max_step_tokens, enable_prefix_caching=False,
                   head_classes=head_class_map(w.head_classes, cfg.num_layers, cfg.num_kv_heads),
                   kv_cache_bytes=kv_cache_bytes)
    eng = Engine(model, **{**options, **(engine_kwargs or {})})  # --engine overrides the workload's own
    # tokens only, as the server asks for them: the random checkpoint's word-level tokenizer would
    # otherwise turn every token into text on the host between steps
    sp = SamplingParams(**{"temperature": 0.0, **(sampling or {})}, max_tokens=w.new, ignore_eos=True,
                        detokenize=False)
    calls = []  # (start, end) of each ragged step call: splits the first token's time into host and call
    run = eng.runner.run

    def timed_run(batch):
        start = time.perf_counter()
        out = run(batch)
        calls.append((start, time.perf_counter()))
        return out

    eng.runner.run = timed_run
    t0 = time.perf_counter()
    ids = [eng.add_request(p, sp) for p in prompts]
    toks = {i: [] for i in ids}
    ttft = all_first = None
    after = 0  # tokens produced once every request had its first one
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for out in outs:
            if ttft is None:
                ttft = now - t0
            if all_first is not None:
                after += len(out.new_token_ids)
            toks[out.request_id].extend(out.new_token_ids)
        if all_first is None and all(toks.values()):
            all_first = now
    total = time.perf_counter() - t0
    decode_step = (t0 + total - all_first) / (after / len(ids)) if after else float("nan")
    if calls and w.batch == 1:
        (start, end), last = calls[0], calls[-1][1]
        print(f"  first token: host before the step call {(start - t0) * 1e3:.1f} ms, step call (upload + "
              f"device + sync) {(end - start) * 1e3:.1f} ms, {len(calls)} step calls in "
              f"{(last - t0) * 1e3:.1f} ms", flush=True)
    return total, ttft, [toks[i] for i in ids], decode_step


# ------------------------------------------------------------------------------------------ transformers

def run_hf(hf_model, w: Workload, prompts, device):
    """Greedy generate with sdpa; (total s, ttft s, tokens per prompt). TTFT = one forward + argmax."""
    import torch

    ids = torch.tensor(prompts, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.inference_mode():
        sync()
        t0 = time.perf_counter()
        hf_model(ids[:, :], logits_to_keep=1).logits.argmax(-1)
        sync()
        ttft = time.perf_counter() - t0
        if w.new == 1:
            return ttft, ttft, None
        t0 = time.perf_counter()
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=w.new,
                                min_new_tokens=w.new, do_sample=False, pad_token_id=0)
        sync()
        total = time.perf_counter() - t0
    return total, ttft, out[:, ids.shape[1]:].tolist()


def agreement(model_dir: Path, small: bool, device: str) -> tuple[float, int]:
    """fp32 greedy: fraction of 8 prompts x 64 new tokens where jaxkv and transformers agree token by token
    (compared up to the first divergence of each prompt)."""
    import torch
    from transformers import LlamaForCausalLM

    import jaxkv
    from jaxkv.sampling import SamplingParams

    n_prompts, plen, new = (2, 16, 8) if small else (8, 300, 64)
    model = jaxkv.load(model_dir, dtype="float32")
    rng = np.random.default_rng(7)
    prompts = rng.integers(3, model.config.vocab_size, size=(n_prompts, plen)).tolist()
    ours = jaxkv.generate(model, prompts, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True),
                          page_size=16, enable_prefix_caching=False, max_num_seqs=1)  # 1: fresh-prompt path
    del model
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    hf = hf.to(device)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    with torch.inference_mode():
        ids = torch.tensor(prompts, device=device)
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)[:, plen:].tolist()
    del hf
    same = 0
    for a, b in zip((o.token_ids for o in ours), ref):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), new)
        same += k
    return same / (n_prompts * new), n_prompts


# ------------------------------------------------------------------------------------------------ driver

def bench_shape(shape: str, small: bool, only: set[str] | None, log, engine_kwargs: dict,
                max_prompt: int = 1 << 30, no_hf: bool = False, sampling=None) -> list[list[str]]:
    import jax
    import torch
    from transformers import LlamaForCausalLM

    import jaxkv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    wls = [w for w in workloads(small) if (not only or w.name in only) and w.prompt <= max_prompt]
    if no_hf:
        wls = [dataclasses.replace(w, hf=False) for w in wls]
    max_len = max([w.prompt + w.new for w in wls] + [256])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / shape
        t0 = time.perf_counter()
        make_checkpoint(shape, path, max_len)
        log(f"[{shape}] checkpoint written in {time.perf_counter() - t0:.1f} s")
        dtype = "float32" if small else "bfloat16"
        model = jaxkv.load(path, dtype=dtype)
        cfg = model.config
        hf_dtype = torch.float32 if small else torch.bfloat16
        hf = None
        if any(w.hf for w in wls):
            hf = LlamaForCausalLM.from_pretrained(path, dtype=hf_dtype, attn_implementation="sdpa").to(device)
        rng = np.random.default_rng(0)
        kv_bytes = (1 << 26) if small else (60 << 30)
        page_size = 16
        results = {}
        for w in wls:
            prompts = rng.integers(3, cfg.vocab_size, size=(w.batch, w.prompt)).tolist()
            fl = floors(w, cfg, 4 if small else 2)
            tag = f"{w.name} {w.batch}x{w.prompt}->{w.new}"
            kw = dict(page_size=page_size, kv_cache_bytes=kv_bytes, engine_kwargs=engine_kwargs,
                      sampling=sampling)
            run_jaxkv(model, w, prompts, **kw)  # compiles
            total, ttft, _, step = run_jaxkv(model, w, prompts, **kw)
            avg_step = (total - ttft) / max(w.new - 1, 1)  # also carries the later requests' prefills
            hf_total = hf_ttft = float("nan")
            if w.hf and hf is not None:
                warm = dataclasses.replace(w, new=min(w.new, 4))
                run_hf(hf, warm, prompts, device)
                hf_total, hf_ttft, _ = run_hf(hf, w, prompts, device)
            results[w.name] = total
            log(f"[{shape}] {tag}: jaxkv total {total:.3f} s ttft {ttft:.4f} s step {step * 1e3:.2f} ms "
                f"((total - ttft) / (new - 1): {avg_step * 1e3:.2f} ms) | "
                f"hf total {hf_total:.3f} s ttft {hf_ttft:.4f} s | floor step {fl['step_s'] * 1e3:.3f} ms "
                f"prefill {fl['prefill_s']:.4f} s")
            gen = w.batch * w.new
            if w.new == 1:
                rows.append([shape, f"{tag}: time to first token (s)", f"{ttft:.4f}", f"{hf_ttft:.4f}",
                             f"{hf_ttft / ttft:.2f}x", f"{fl['prefill_s']:.3g}",
                             f"{ttft / fl['prefill_s']:.2f}x"])
                continue
            rows.append([shape, f"{tag}: end to end (s; {gen / total:,.0f} tok/s)", f"{total:.3f}",
                         f"{hf_total:.3f}" if w.hf else "—", f"{hf_total / total:.2f}x" if w.hf else "—",
                         f"{fl['total_s']:.3g}",
                         f"{total / fl['total_s']:.2f}x"])
            rows.append([shape, f"{tag}: decode step (ms)", f"{step * 1e3:.2f}",
                         f"{(hf_total - hf_ttft) / (w.new - 1) * 1e3:.2f}" if w.hf else "—",
                         f"{(hf_total - hf_ttft) / (w.new - 1) / step:.2f}x" if w.hf else "—",
                         f"{fl['step_s'] * 1e3:.3g}", f"{step / fl['step_s']:.2f}x"])
        if "headclass" in results and "headclass-allglobal" in results:
            rows.append([shape, "head-class (1 of 8 KV heads global) vs all global, same engine: speed-up",
                         f"{results['headclass-allglobal'] / results['headclass']:.2f}x", "—", "—", "", ""])
        del hf
        if not only or "agree" in only:
            frac, n = agreement(path, small, device)
            rows.append([shape, f"fp32 greedy agreement with transformers, {n} prompts (tokens before the "
                                f"first divergence / all)", f"{frac:.3f}", "", "", "", ""])
        del model
        jax.clear_caches()
    return rows


HEADER = ["model", "row", "jaxkv", "transformers (sdpa)", "speed-up vs transformers", "floor",
          "jaxkv / floor"]


def main(argv=None) -> list[list[str]]:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.e2e", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model on CPU (smoke mode for tests)")
    ap.add_argument("--shapes", default="1b",
                    help="comma list of " + ",".join(s for s in SHAPES if not s.startswith("small")))
    ap.add_argument("--only", default="", help="comma list of row names (batch,ttft,single,short,headclass,"
                                               "headclass-allglobal,agree)")
    ap.add_argument("--out", default=None, help="markdown file whose 'End to end' section is replaced")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--max-prompt", type=int, default=1 << 30, help="skip workloads with longer prompts")
    ap.add_argument("--no-hf", action="store_true", help="jaxkv rows only (no transformers timings)")
    ap.add_argument("--engine", default="{}",
                    help='extra Engine keyword arguments as JSON, e.g. \'{"decode_steps": 32}\'')
    ap.add_argument("--sampling", default="{}",
                    help='jaxkv\'s sampling settings as JSON (default greedy), e.g. \'{"temperature": 1.0, '
                         '"top_p": 0.9, "seed": 0}\'')
    args = ap.parse_args(argv)
    shapes = ["small"] if args.small else [s.strip() for s in args.shapes.split(",") if s.strip()]
    only = {s.strip() for s in args.only.split(",") if s.strip()} or None

    def log(msg):
        print(msg, flush=True)

    rows = []
    for shape in shapes:
        rows += bench_shape(shape, args.small, only, log, json.loads(args.engine), args.max_prompt,
                            args.no_hf, json.loads(args.sampling))
    cmd = command_line("benchmarks.e2e", argv)
    table = markdown_table(HEADER, rows)
    sampled = "Greedy" if args.sampling.strip() in ("", "{}") else f"jaxkv sampling {args.sampling}"
    body = (f"Command: `{cmd}`\n\n{describe_device(('torch', 'transformers'))} Random-weight checkpoints "
            "saved by transformers and loaded "
            "by `jaxkv.load` (bf16; fp32 for the agreement row). "
            f"{sampled}, EOS ignored, prefix caching off, a "
            "fresh engine per run, the second run timed (the first compiles); transformers: `generate` with "
            "sdpa after a short warm-up, TTFT = one forward over the prompt. Floors: decode step = (weights "
            f"+ KV the step must read) / {COPY_BW / 1e12:.1f} TB/s; prefill = matmul FLOPs / "
            f"{MATMUL_RATE / 1e12:.0f} TFLOP/s; end to end = prefill + (new - 1) steps. "
            "jaxkv's decode step is "
            "timed once every request has its first token (the later requests' prefills excluded); "
            "transformers' is (generate - one forward over the prompts) / (new - 1). Speed-up > 1 means "
            "jaxkv is faster.\n\n"
            + table + "\n")
    print(table)
    if args.out:
        write_section(Path(args.out), "End to end (engine vs transformers)", body)
    if args.json:
        write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
