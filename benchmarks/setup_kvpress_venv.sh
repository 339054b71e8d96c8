#!/usr/bin/env bash
# A separate venv for kvpress, the peer oracle of python -m benchmarks.kvpress (not a project dependency).
# kvpress 0.5.5 pins transformers<5.3; installed with --no-deps next to the project's transformers 5.23 it
# imports but fails at the first prefill (KeyError: 'cache_position' in BasePress.forward_hook: newer
# transformers no longer pass cache_position to the attention layers), so it gets its own environment.
# Usage: bash benchmarks/setup_kvpress_venv.sh [VENV_DIR]   (default ./kvvenv; then KVPRESS_PYTHON=VENV_DIR/bin/python)
set -euo pipefail
VENV="${1:-kvvenv}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0          # the CPU wheel; plain `torch` would pull the CUDA build
"$VENV/bin/pip" install -q "transformers<5.3" "kvpress==0.5.5"
"$VENV/bin/python" -c "import kvpress, transformers, torch; print('kvpress ok: transformers', transformers.__version__, 'torch', torch.__version__)"
