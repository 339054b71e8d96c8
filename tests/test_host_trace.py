"""benchmarks.host_trace: self time per compiler stage from a real `jax.profiler` trace."""

import jax
import jax.numpy as jnp

from benchmarks.host_trace import stage, traced


def test_a_traced_compile_names_its_compiler_stages_and_cpu_time(tmp_path):
    def f(x, w):
        for _ in range(3):
            x = jnp.tanh(x @ w)
        return x

    with traced(str(tmp_path)) as out:
        for n in (16, 32):
            jax.jit(f).lower(jnp.ones((n, 64)), jnp.ones((64, 64))).compile()
    assert out["cpu_s"] > 0 and out["wall_s"] > 0 and out["cores_busy"] > 0
    stages = out["host_self_s"]
    assert stages and all(v >= 0 for v in stages.values())
    # XLA's compile is traced on the host: some stage of it is named (the CPU client's or the GPU's)
    assert any("Compile" in k or "compile" in k for k in stages), stages


def test_untraced_gives_times_only():
    with traced(None) as out:
        sum(range(1000))
    assert set(out) == {"wall_s", "cpu_s", "cores_busy"}


def test_stage_names_drop_their_module_suffix():
    assert stage("GpuCompiler::RunHloPasses for jit_step") == "GpuCompiler::RunHloPasses"
    assert stage("Compiling IR:sort.18.1") == stage("Compiling IR:LLVMDialectModule") == "Compiling IR"
    assert stage("PjitFunction(step)") == "PjitFunction"


def test_the_command_prints_a_trace_directorys_stages(tmp_path, capsys):
    from benchmarks.host_trace import main

    with traced(str(tmp_path)):
        jax.jit(lambda x: x * 2).lower(jnp.ones(8)).compile()
    main([str(tmp_path), "--top", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| stage | self seconds |" and len(lines) == 2 + 3
