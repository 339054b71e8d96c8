import os

# Tests run on CPU with full fp32 matmuls so parity checks measure the code, not TF32/bf16 defaults.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
