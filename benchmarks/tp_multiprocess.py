"""Multi-process tensor parallelism on one host: one process per GPU through `jax.distributed.initialize`.

The launcher starts `--num-processes` workers of this module (worker i sees GPU i through
CUDA_VISIBLE_DEVICES, or `--cpu-devices` forced CPU devices), each calls
`jax.distributed.initialize(coordinator, num_processes, process_id)`, builds the `tp` mesh over all
processes' devices (`jaxkv.parallel.make_mesh(len(jax.devices()))`), places the same random tiny model on
it and runs the same greedy requests through its own `Engine`: every process runs the identical host
schedule (same inputs, same decisions) and drives its own devices of each step (SPMD, multi-controller).
The launcher then runs one single-process, single-device reference and checks the tokens are equal.

    python -m benchmarks.tp_multiprocess --num-processes 2                   # GPU host, one process a GPU
    python -m benchmarks.tp_multiprocess --num-processes 2 --cpu-devices 2   # CPU: 2 processes x 2 devices
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.harness import repo_root, subprocess_env

SELF = [sys.executable, "-m", "benchmarks.tp_multiprocess"]


def tiny_config():
    from jaxkv.config import ModelConfig

    return ModelConfig(family="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
                       num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16, rms_norm_eps=1e-5,
                       max_position_embeddings=256)


def generate(mesh) -> list[list[int]]:
    import jax

    from jaxkv.engine.engine import Engine
    from jaxkv.loading import Model
    from jaxkv.models import llama
    from jaxkv.parallel import place_and_shard
    from jaxkv.sampling import SamplingParams

    cfg = tiny_config()
    with jax.default_device(jax.local_devices(backend="cpu")[0]):  # same host values in every process
        params = jax.tree.map(np.asarray, llama.init_params(cfg, jax.random.PRNGKey(0), scale=0.1))
    perm = None
    if mesh is not None:
        params, perm = place_and_shard(params, cfg, mesh)
    model = Model(cfg, params, None, {}, "tiny-mp", Path("/nonexistent"), mesh, perm)
    engine = Engine(model, page_size=4, max_model_len=96, max_num_seqs=4, max_step_tokens=16,
                    enable_prefix_caching=False, head_classes=None)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, size=n).tolist() for n in (7, 23, 40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ids = [engine.add_request(p, greedy) for p in prompts]
    got = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    return [got[i] for i in ids]


def worker(args) -> None:
    import jax

    if args.cpu_devices:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                               process_id=args.worker)
    from jaxkv.parallel.mesh import make_mesh

    mesh = make_mesh(len(jax.devices()))
    tokens = generate(mesh)
    if jax.process_index() == 0:
        print("RESULT " + json.dumps({"tokens": tokens, "devices": len(jax.devices()),
                                      "processes": jax.process_count(),
                                      "kind": jax.devices()[0].device_kind}), flush=True)
    jax.distributed.shutdown()


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.tp_multiprocess", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--cpu-devices", type=int, default=0, help="forced CPU devices per process (no GPU)")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.reference:
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")
        print("RESULT " + json.dumps({"tokens": generate(None)}), flush=True)
        return
    if args.worker is not None:
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")
        worker(args)
        return

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(args.num_processes):
        env = subprocess_env()
        if args.cpu_devices:
            flags = f"--xla_force_host_platform_device_count={args.cpu_devices}"
            env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        cmd = [*SELF, "--worker", str(i), "--num-processes", str(args.num_processes),
               "--coordinator", f"127.0.0.1:{port}", "--cpu-devices", str(args.cpu_devices)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, cwd=repo_root()))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        for i, o in enumerate(outs):
            print(f"--- worker {i} (rc {procs[i].returncode})\n{o[-3000:]}")
        sys.exit(1)
    result = json.loads([ln for ln in outs[0].splitlines() if ln.startswith("RESULT ")][-1][7:])
    env = subprocess_env()
    if args.cpu_devices:
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env["CUDA_VISIBLE_DEVICES"] = "0"
    ref_out = subprocess.run([*SELF, "--reference"], env=env, capture_output=True, text=True, timeout=600,
                             cwd=repo_root())
    ref = json.loads([ln for ln in ref_out.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    same = result["tokens"] == ref["tokens"]
    print(f"{result['processes']} processes, {result['devices']} devices ({result['kind']}), tp mesh over "
          f"all: greedy tokens equal to one device: {same}")
    print("tokens:", result["tokens"][0])
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
