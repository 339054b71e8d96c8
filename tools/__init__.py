"""Builders of the assets shipped with jaxkv, run from the repository root as ``python -m tools.<module>``
(not part of the installed package): ``train_tiny`` (the embedded default model), ``distil_retrieval_head``
(its SpeContext retrieval head), ``profile_heads`` (a model's head-class map) and ``calibrate_hardkv``
(HARD-KV's per-head temperatures)."""
