import os

# Tests run on CPU with full fp32 matmuls so parity checks measure the code, not TF32/bf16 defaults.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

from jaxkv.engine.code_maps import MapGuard  # noqa: E402

# One xdist worker runs hundreds of tests and keeps every executable they compiled; XLA:CPU maps each
# kernel separately, and a worker near vm.max_map_count dies with SIGSEGV in whichever test compiles next
# (jaxkv/engine/code_maps.py). Clearing well below the engine's own threshold keeps its guard out of the
# way of tests that count compilations.
_MAPS = MapGuard(fraction=0.4, every=8)


@pytest.fixture(autouse=True)
def _below_the_mapping_cap():
    _MAPS.check()
    yield
