"""A reuse eval request the context cannot hold is reported with the engine's reason, not a missing key."""

import pytest

from tests.hf_tiny import make_tiny_checkpoint


def test_reuse_eval_says_why_a_request_does_not_fit(tmp_path):
    import jaxkv
    from jaxkv.eval.registry import PromptPieces, get_method

    model = jaxkv.load(make_tiny_checkpoint("llama", tmp_path / "m", max_position_embeddings=256))
    method = get_method("naive", model)
    # 8 segments of 17 tokens: each starts on a fresh 16-slot page, so the layout takes 8 more pages per head
    # than its 228 tokens; with the answer's page the engine's 16 pages per head (256 positions) are too few.
    segments = [[5 + (i * 17 + j) % 90 for j in range(17)] for i in range(8)]
    pieces = PromptPieces([1], segments, list(range(3, 94)))
    assert len(pieces.ids) + 16 <= 256  # the tokens alone fit the context
    with pytest.raises(RuntimeError, match="does not fit"):
        method.run(pieces, max_new_tokens=16, stop_ids=())
