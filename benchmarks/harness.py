"""What every benchmark shares: named model shapes and random weights for them, timing, the device line,
markdown tables and sections, the exact command line, and result files.

A benchmark's numbers mean something only next to the command and the machine that produced them, so every
report made here carries both (`command_line`, `describe_device`).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

# ------------------------------------------------------------------------------------------------ shapes

SHAPES = {  # jaxkv ModelConfig fields of the Llama shapes the benchmarks use
    "small": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, vocab_size=512, tie_word_embeddings=True),
    # CPU smoke shape that splits over up to 4 devices (4 KV heads)
    "small-tp4": dict(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8, num_kv_heads=4,
                      head_dim=16, vocab_size=512, tie_word_embeddings=False),
    # the 8B shape's page layout (32 layers x 8 KV heads, 2 query heads each) with tiny hidden/head sizes:
    # host-side costs of a reuse pass measured on the CPU, where compute is cheap
    "8b-layout": dict(hidden_size=64, intermediate_size=128, num_layers=32, num_heads=16, num_kv_heads=8,
                      head_dim=8, vocab_size=512, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
               head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
               head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
                head_dim=128, vocab_size=128256, tie_word_embeddings=False),
}
ROPE_THETA, RMS_NORM_EPS = 500000.0, 1e-5  # Llama 3's
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads"}

# Throughput floors: the H200's measured device copy rate (~3.3-4.3 TB/s) and its bf16 matmul rate.
COPY_BW = 4.0e12      # bytes/s
MATMUL_RATE = 790e12  # FLOP/s

SINK, WINDOW = 64, 256  # a local head's sink + window in the synthetic head-class maps


def hf_fields(shape: str) -> dict:
    """`SHAPES[shape]` under transformers' LlamaConfig names."""
    return {_HF_NAMES.get(k, k): v for k, v in SHAPES[shape].items()}


def model_config(shape: str, max_len: int):
    """The jaxkv ModelConfig of a named shape holding `max_len` positions."""
    from jaxkv.config import ModelConfig

    return ModelConfig(family="llama", max_position_embeddings=max_len, rope_theta=ROPE_THETA,
                       rms_norm_eps=RMS_NORM_EPS, **SHAPES[shape])


@contextlib.contextmanager
def _torch_default_dtype(dtype):
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def make_checkpoint(shape: str, path: Path, max_len: int, init_dtype: str | None = None) -> None:
    """A random-weight Llama checkpoint of `shape`, saved in bf16 by transformers (the format real ones
    come in, read by `jaxkv.load` and by transformers alike). `init_dtype="bfloat16"` builds the modules in
    bf16 directly: an 8B model in half the memory and time of fp32 + cast. Builds on CUDA when torch can
    and hands its cached memory back before JAX preallocates."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**hf_fields(shape), max_position_embeddings=max(max_len, 1024), rope_theta=ROPE_THETA,
                      rms_norm_eps=RMS_NORM_EPS, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, init_dtype) if init_dtype else torch.get_default_dtype()
    with _torch_default_dtype(dtype), torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path)
    del model
    if device == "cuda":  # an 8B fp32 build is 32 GB
        torch.cuda.empty_cache()
    write_word_tokenizer(path, cfg.vocab_size)


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def write_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level `tokenizer.json` of the model's vocabulary size (`<unk>`, `<s>`, `</s>`, then `w3`,
    `w4`, ...; words split on whitespace and punctuation) with a plain chat template, so `python -m
    jaxkv.serve` serves a random-weight checkpoint: speed runs need the server, not a real vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(Path(path) / "tokenizer.json"))
    (Path(path) / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}))


def cached_checkpoint(shape: str, path: Path, max_len: int, log=print) -> Path:
    """`make_checkpoint` into `path`, or the one already there when it was made for the same shape and
    length (big shapes take minutes to build and save)."""
    marker = path / "jaxkv_bench_checkpoint.json"
    want = {"shape": shape, "fields": SHAPES[shape], "max_len": max_len}
    t0 = time.perf_counter()
    if marker.exists() and json.loads(marker.read_text()) == want:
        log(f"[{shape}] checkpoint reused: {path}")
        return path
    make_checkpoint(shape, path, max_len, init_dtype="bfloat16")
    marker.write_text(json.dumps(want))
    log(f"[{shape}] checkpoint written in {time.perf_counter() - t0:.1f} s: {path}")
    return path


def random_model(shape: str, dtype: str, max_len: int):
    """A `jaxkv.loading.Model` of `shape` with random weights made on the device (no checkpoint on disk):
    for runs whose timings do not depend on the weights or the tokenizer."""
    import jax
    import jax.numpy as jnp

    from jaxkv.loading import Model
    from jaxkv.models import llama

    cfg = model_config(shape, max_len)
    params = jax.jit(lambda k: llama.init_params(cfg, k, jnp.dtype(dtype)))(jax.random.key(0))
    return Model(cfg, params, None, {}, f"random-{shape}", None)


def head_class_map(kind: str, layers: int, kv_heads: int):
    """"global": every head keeps its whole history; "1of8": KV head 0 of every layer global, the others
    sink + window (a smaller window on toy shapes, whose prompts are short)."""
    from jaxkv.cache.head_classes import HeadClass, HeadClassMap, all_global

    if kind == "global":
        return all_global(layers, kv_heads)
    if kind != "1of8":
        raise ValueError(f"unknown head-class map {kind!r}: global or 1of8")
    sink, window = (SINK, WINDOW) if kv_heads > 2 or layers > 2 else (4, 16)
    row = (HeadClass.global_(),) + (HeadClass.local(sink, window),) * (kv_heads - 1)
    return HeadClassMap(layers, kv_heads, (row,) * layers)


# ------------------------------------------------------------------------------------------------ timing

def time_device(fn, *args, iters: int = 10, warmup: int = 2, rounds: int = 3, alts=()) -> float:
    """ms per call of `fn`: `warmup` calls, then `rounds` rounds of `iters` calls enqueued back to back with
    one `block_until_ready` at the end (one stream: in order), the median round. Device time per call as
    long as dispatch keeps ahead of the device. `alts`: further argument tuples rotated with `args` (a
    fresh input per call)."""
    import jax

    sets = [tuple(args)] + [tuple(a) for a in alts]
    for i in range(warmup):
        jax.block_until_ready(fn(*sets[i % len(sets)]))
    per = []
    for _ in range(rounds):
        out = None
        t = time.perf_counter()
        for i in range(iters):
            out = fn(*sets[i % len(sets)])
        jax.block_until_ready(out)
        per.append((time.perf_counter() - t) / iters)
        del out
    return float(np.median(per)) * 1e3


def time_host(fn, *args, iters: int = 10, warmup: int = 2, alts=()) -> float:
    """ms per call of `fn`: the median of `iters` calls, each timed with the host clock around
    `block_until_ready` (dispatch and sync included)."""
    import jax

    sets = [tuple(args)] + [tuple(a) for a in alts]
    for i in range(warmup):
        jax.block_until_ready(fn(*sets[i % len(sets)]))
    ts = []
    for i in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*sets[i % len(sets)]))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def time_state(step, state, *, iters: int = 10, warmup: int = 2, rounds: int = 3, host: bool = False):
    """`time_device` / `time_host` for a donating `step`: state -> state (each call consumes the last
    output). Returns (ms per call, the final state)."""
    import jax

    for _ in range(warmup):
        state = step(state)
    jax.block_until_ready(state)
    per = []
    for _ in range(iters if host else rounds):
        t = time.perf_counter()
        for _ in range(1 if host else iters):
            state = step(state)
        jax.block_until_ready(state)
        per.append((time.perf_counter() - t) / (1 if host else iters))
    return float(np.median(per)) * 1e3, state


# ---------------------------------------------------------------------------------- device and command

def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_device(libs: tuple[str, ...] = ()) -> str:
    """"Device: N x <kind> (<backend>), jax X[, <lib> Y...], Python Z." (the host's CPU on a CPU backend)."""
    import importlib

    import jax

    devs = jax.devices()
    kind = cpu_name() if jax.default_backend() == "cpu" else devs[0].device_kind
    count = f"{len(devs)} x " if len(devs) > 1 else ""
    versions = [f"jax {jax.__version__}"]
    for name in libs:
        versions.append(f"{name} {importlib.import_module(name).__version__}")
    return (f"Device: {count}{kind} ({jax.default_backend()}), {', '.join(versions)}, "
            f"Python {platform.python_version()}.")


def command_line(module: str, argv=None) -> str:
    """The exact command that reruns this benchmark: `python -m <module> <argv>` (argv default: this
    process's arguments)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", "-m", module, *args])


# ----------------------------------------------------------------------------------------------- reports

def markdown_table(header: list[str], rows) -> str:
    """A markdown table; cells are written with str()."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_section(path: Path, title: str, body: str, keep_subsections: bool = True) -> None:
    """Replaces section ``## title`` of the markdown file `path` with `body` (appended when absent; the
    file is created). `keep_subsections`: only the section's lead is replaced, up to its first ``###``
    subsection (the record of earlier runs), which stays. Other sections stay."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    head = f"## {title}"
    start = text.find(head + "\n")
    section = f"{head}\n\n{body.rstrip()}\n"
    if start < 0:
        text = text.rstrip() + "\n\n" + section
    else:
        ends = [text.find("\n## ", start + len(head))]
        if keep_subsections:
            ends.append(text.find("\n### ", start + len(head)))
        ends = [i for i in ends if i >= 0]
        nxt = min(ends) if ends else -1
        text = text[:start] + section + ("\n" + text[nxt + 1:] if nxt >= 0 else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_json(path, data) -> Path:
    """`data` as indented JSON at `path` (its directory created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path


def append_jsonl(path, row: dict) -> None:
    """One JSON line appended to `path` (its directory created): rows survive a killed run."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def repo_root() -> Path:
    """The repository root (benchmarks/ sits in it); subprocesses run from here."""
    return Path(__file__).resolve().parents[1]


def subprocess_env(**extra) -> dict:
    """This process's environment with the repository root first on PYTHONPATH, so a child started with
    `python -m benchmarks.x` or `python -m jaxkv.x` imports this tree from any working directory."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root()), env.get("PYTHONPATH")]))
    return env
