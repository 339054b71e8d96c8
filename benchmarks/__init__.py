"""Repository benchmarks, run from the repository root as ``python -m benchmarks.<module>`` (not part of the
installed ``jaxkv`` package): ``harness`` (shared shapes, random checkpoints, timing, device line, markdown
and JSON output), ``e2e`` (engine vs transformers), ``kernels`` (Pallas kernels vs their anchors),
``policy`` (decode under KV compression), ``retrieval`` (retrieval policies and host-tier bytes), ``reuse``
(segment-reuse TTFT), ``serve`` (the OpenAI server through the official client), ``startup`` (step variants
compiled and their time), ``tp`` and ``tp_multiprocess`` (tensor parallelism), ``cpu_real`` (SmolLM2 on CPU
vs transformers), ``kvpress`` with ``kvpress_side`` (policies vs kvpress's presses), ``eval_grid`` (accuracy
over tasks x contexts x methods), ``eval_reuse`` (reuse methods on the RAG tasks), ``profile_decode``
(kernels of a traced decode step) and ``stress_serve`` (load, fuzz and fault suite for the server)."""
