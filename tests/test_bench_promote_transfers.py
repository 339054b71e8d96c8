"""`python -m benchmarks.promote_transfers` on a small layout (CPU): it counts the transfers a promotion
issues from host memory kind copies, one `jax.device_put` per layer group (plus the grouped pass's own
inputs)."""

from benchmarks import promote_transfers


def test_promote_transfers_counts_one_device_put_per_layer_group():
    rows = promote_transfers.main(["--layers", "4", "--kv-heads", "2", "--segments", "3",
                                   "--segment-len", "32", "--groups", "1,2", "--repeats", "1"])
    one, two = rows
    assert (one["programs"], two["programs"]) == (1, 2)
    # one program: the promotion's single call (page ids, positions, one block per segment)
    assert (one["puts"], one["arrays"]) == (1, 2 + 3)
    # two groups: a call per group, and one for the pass's inputs, all before the first program
    assert two["puts"] == two["puts_before_first"] == 3
    assert one["first_dispatch_ms"] > 0 and two["first_dispatch_ms"] > 0
    out = promote_transfers.main(["--device-put", "--layers", "4", "--segments", "2", "--segment-len", "16",
                                  "--repeats", "1"])
    assert [r["transfers"] for r in out] == ["8 arrays per call, 2 calls", "16 arrays in one call",
                                             "2 arrays in one call"]


def test_the_counter_restores_what_it_wraps():
    import jax

    import jaxkv.engine.reuse as reuse_mod

    put, prefill = jax.device_put, reuse_mod.reuse_prefill
    with promote_transfers.TransferCounter():
        assert jax.device_put is not put and reuse_mod.reuse_prefill is not prefill
    assert jax.device_put is put and reuse_mod.reuse_prefill is prefill
