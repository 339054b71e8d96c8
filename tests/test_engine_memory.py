"""The server's device-sized KV pool (jaxkv/engine/memory.py, `jaxkv.serve --memory-utilization`)."""

import pytest

from jaxkv.engine.memory import ACTIVATION_RESERVE, device_kv_bytes, pool_bytes

GIB = 2**30


def test_pool_bytes_is_the_limit_share_less_weights_and_reserve():
    stats = {"bytes_limit": 100 * GIB, "bytes_in_use": 3 * GIB}
    assert pool_bytes(stats, 0.9) == 90 * GIB - 3 * GIB - ACTIVATION_RESERVE
    assert pool_bytes(stats, 0.5, reserve=0) == 47 * GIB
    assert pool_bytes({"bytes_limit": 10 * GIB}, 1.0, reserve=GIB) == 9 * GIB  # nothing in use yet


def test_pool_bytes_errors():
    with pytest.raises(ValueError, match="no device memory left"):
        pool_bytes({"bytes_limit": 4 * GIB, "bytes_in_use": 3 * GIB}, 0.9)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="utilization"):
            pool_bytes({"bytes_limit": GIB}, bad)


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_device_kv_bytes_reads_allocator_stats_or_gives_none():
    dev = _Device({"bytes_limit": 40 * GIB, "bytes_in_use": 2 * GIB})
    assert device_kv_bytes(0.9, dev, reserve=0) == 34 * GIB
    assert device_kv_bytes(0.9, _Device(None)) is None  # the CPU reports no stats: the engine default applies
    assert device_kv_bytes(0.9, _Device({})) is None
    assert device_kv_bytes(0.9) is None  # this CPU backend


def test_serve_rejects_a_bad_utilization(capsys):
    from jaxkv.serve.__main__ import parse_args

    for bad in ("0", "1.2"):
        with pytest.raises(SystemExit):
            parse_args(["--memory-utilization", bad])
        assert "--memory-utilization must lie in (0, 1]" in capsys.readouterr().err
    assert parse_args(["--memory-utilization", "0.5"]).memory_utilization == 0.5


def test_serve_retrieval_rows_default_and_bad_values(capsys):
    """SpeContext's state rows: 32 where requests choose it, every sequence where it is the engine-wide
    policy, as asked otherwise (never above max_num_seqs); 0 is refused."""
    from jaxkv.serve.__main__ import parse_args, retrieval_max_seqs

    with pytest.raises(SystemExit):
        parse_args(["--retrieval-max-seqs", "0"])
    assert "--retrieval-max-seqs must be a positive integer" in capsys.readouterr().err
    args = parse_args([])
    args.kv_policy_obj = None
    assert retrieval_max_seqs(args, 256) == 32 and retrieval_max_seqs(args, 8) == 8
    from jaxkv.policies import get_policy

    args.kv_policy_obj = get_policy("specontext")
    assert retrieval_max_seqs(args, 256) == 256
    args = parse_args(["--retrieval-max-seqs", "64"])
    args.kv_policy_obj = None
    assert retrieval_max_seqs(args, 256) == 64 and retrieval_max_seqs(args, 16) == 16


def test_step_activation_bytes_covers_a_measured_step():
    """The estimate the server keeps free beside its pool: at least what XLA's memory analysis reported
    for the 1B shape's 32K-token fresh step on an H100 (2.39 GiB), and proportional to the tokens."""
    from benchmarks.harness import model_config
    from jaxkv.engine.memory import step_activation_bytes

    cfg = model_config("1b", 32768)
    need = step_activation_bytes(cfg, 32768, 2)
    assert 2.39 * GIB <= need <= 3 * GIB
    assert step_activation_bytes(cfg, 8192, 2) * 4 == need
    assert step_activation_bytes(cfg, 8192, 4) > step_activation_bytes(cfg, 8192, 2)


def test_server_autotunes_unless_told_not_to():
    """Without autotuning a GPU decode step's GEMMs take default tilings (3.5x slower on an H100), so the
    server keeps XLA's autotuning on; --no-xla-autotune turns it off and a level in XLA_FLAGS wins."""
    from jaxkv.serve.__main__ import NO_AUTOTUNE, parse_args, xla_flags

    assert parse_args([]).xla_autotune is True
    assert parse_args(["--no-xla-autotune"]).xla_autotune is False
    assert xla_flags("", autotune=True) == ""
    assert xla_flags("", autotune=False) == NO_AUTOTUNE
    assert xla_flags("--xla_dump_to=/tmp/d", autotune=False) == f"--xla_dump_to=/tmp/d {NO_AUTOTUNE}"
    assert xla_flags("--xla_gpu_autotune_level=4", autotune=False) == "--xla_gpu_autotune_level=4"
    assert xla_flags("--xla_dump_to=/tmp/d", autotune=True) == "--xla_dump_to=/tmp/d"


def test_autotuning_only_for_programs_of_few_rows(tmp_path, monkeypatch):
    """`autotune_max_rows`: on a GPU a precompiled program above the limit (a step's tokens, a decode's
    sequences, a reuse pass's rows) compiles with autotuning off, the others with XLA's own flags; the step
    cache keys the two apart. The server's --autotune-max-rows sets it."""
    import jax
    import numpy as np

    from jaxkv.engine import warmup
    from jaxkv.engine.config import EngineConfig
    from jaxkv.engine.step_cache import StepCache
    from jaxkv.serve.__main__ import parse_args

    class Eng:
        config = EngineConfig(autotune_max_rows=256)

    eng = Eng()
    step, decode = ("step", 8, 512, 64, True, False, 0, False), ("decode", 512, 0, 64, True, False, 0, False)
    small, reuse = ("step", 4, 128, 64, True, False, 0, False), ("reuse naive", 1024, 4096, 256)
    assert [warmup.program_rows(v) for v in (step, decode, small, reuse)] == [512, 512, 128, 1024]
    assert warmup.program_rows(("compress", 8, 0, 64, "snapkv")) is None
    assert warmup.compile_options(eng, step) is None  # the CPU: nothing to autotune
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    off = warmup.LARGE_ROW_OPTIONS
    assert [warmup.compile_options(eng, v) for v in (step, decode, small, reuse)] == [off, off, None, off]
    assert warmup.compile_options(eng, ("compress", 8, 0, 64, "snapkv")) is None
    eng.config = EngineConfig()
    assert warmup.compile_options(eng, step) is None  # no limit: XLA's flags for every program
    cache = StepCache(tmp_path, "fp")
    args = (None, None, np.zeros(3, np.int32))
    assert cache.key(len, args, {}) != cache.key(len, args, {}, off) == cache.key(len, args, {}, off)
    assert parse_args(["--autotune-max-rows", "256"]).autotune_max_rows == 256
    assert parse_args([]).autotune_max_rows == 512  # 0: autotune every program
    with pytest.raises(SystemExit):
        parse_args(["--autotune-max-rows", "-1"])


def test_retrieval_states_are_counted_beside_the_pool(tmp_path):
    """SpeContext keeps a key row of every slot per sequence, made after the pool: a server sizing its pool
    from memory keeps its bytes free (the 8B shape at 256 x 32K: ~17 GB). Counted from shapes, nothing made;
    a stateless method (Quest) adds nothing."""
    import jax

    import jaxkv
    from jaxkv.engine.memory import retrieval_state_bytes
    from jaxkv.policies.retrieve import specontext as sc
    from jaxkv.policies.retrieve.quest import Quest
    from tests.hf_tiny import make_tiny_checkpoint

    model = jaxkv.load(make_tiny_checkpoint("llama", tmp_path / "ckpt"))
    cfg = model.config
    head = sc.HeadConfig.for_model(cfg, tap_layer=1, model_id=model.model_id)
    sc.save_head(tmp_path / "head", sc.init_head(head, jax.random.key(0)), {"random": True})
    spec = sc.SpeContext(head_dir=str(tmp_path / "head"))
    itemsize = jax.tree.leaves(model.params)[0].dtype.itemsize  # the key dtype follows the model's
    want = 8 * 96 * head.num_kv_heads * head.head_dim * itemsize
    assert retrieval_state_bytes([spec], model, 8, 96) == want > 0
    assert retrieval_state_bytes([spec, Quest(budget=16)], model, 8, 96) == want
    assert retrieval_state_bytes([], model, 8, 96) == 0
