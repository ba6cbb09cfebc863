"""The attention table: every implementation against "explicit" with a dense
mask, the mask description against a reference written from its rules,
selection and reporting."""

import keras
import numpy as np
import pytest

from kbert.layers import AttentionMask, MultiHeadSelfAttention, TransformerEncoderBlock
from kbert.layers import attention as attention_lib

B, T, N, D = 3, 7, 2, 4


def reference_mask(
    padding, segments=None, causal=False, prefix=None, window=None, glob=None, fallback=True
):
    """(B, T, T) bool from the rules in `kbert.layers.masks`, one entry at a time
    (`fallback=False`: a query that sees no key keeps an empty row)."""
    out = np.zeros((len(padding), T, T), bool)
    for b in range(len(padding)):
        for t in range(T):
            for s in range(T):
                local = True
                if causal:
                    local = s <= t or (prefix is not None and s < prefix[b])
                if window is not None:
                    local = local and abs(t - s) <= window
                if glob is not None and (glob[b, t] or glob[b, s]):
                    local = True
                ok = local and padding[b, s] != 0
                if segments is not None:
                    ok = ok and segments[b, t] == segments[b, s]
                out[b, t, s] = ok
            if fallback and not out[b, t].any():
                out[b, t] = True
    return out


def random_masks(rng):
    lengths = np.array([T, 4, 0])
    padding = (np.arange(T)[None] < lengths[:, None]).astype("int32")
    segments = np.array([[1, 1, 2, 2, 2, 3, 3], [1, 2, 2, 2, 0, 0, 0], [0] * T], "int32")
    random_padding = (rng.random((B, T)) < 0.7).astype("int32")
    glob = np.zeros((B, T), "int32")
    glob[:, 0] = 1
    glob[1, 3] = 1
    prefix = np.array([3, 1, 0], "int32")
    return {
        "padding": (dict(padding=padding), dict()),
        "random-padding": (dict(padding=random_padding), dict()),
        "segments": (dict(padding=padding, segments=segments), dict(segments=segments)),
        "causal": (dict(padding=padding, causal=True), dict(causal=True)),
        "prefix": (
            dict(padding=padding, causal=True, prefix_lengths=prefix),
            dict(causal=True, prefix=prefix),
        ),
        "window": (dict(padding=random_padding, window=2), dict(window=2)),
        "window-global": (
            dict(padding=padding, window=1, global_tokens=glob),
            dict(window=1, glob=glob),
        ),
    }


@pytest.mark.parametrize(
    "kind",
    ["padding", "random-padding", "segments", "causal", "prefix", "window", "window-global"],
)
def test_dense_mask_follows_the_rules(kind):
    parts, rules = random_masks(np.random.default_rng(0))[kind]
    got = keras.ops.convert_to_numpy(AttentionMask(**parts).dense(T, T))
    want = reference_mask(parts["padding"], **rules)
    np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)


def test_every_implementation_equals_explicit_on_random_masks():
    """Each implementation that takes a call gives explicit's output (fp32,
    1e-5) on every query that sees some key (the others are padding, whose
    outputs are unspecified: finite is enough); "explicit" itself equals a
    numpy softmax over the reference mask on every row."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=(B, T, N, D)).astype("float32") for _ in range(3))
    no_dropout = attention_lib.AttentionDropout(0.0, None)
    explicit = attention_lib.ATTENTION_IMPLEMENTATIONS["explicit"]
    checked = set()
    for kind, (parts, rules) in random_masks(rng).items():
        mask = AttentionMask(**parts)
        want = keras.ops.convert_to_numpy(explicit.attend(q, k, v, mask, 0.5, no_dropout))
        dense = reference_mask(parts["padding"], **rules)
        scores = np.einsum("btnd,bsnd->bnts", q, k) * 0.5
        scores = np.where(dense[:, None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        np.testing.assert_allclose(
            want, np.einsum("bnts,bsnd->btnd", probs, v), atol=1e-5, err_msg=kind
        )
        specified = reference_mask(parts["padding"], **rules, fallback=False).any(-1)  # (B, T)
        for name, implementation in attention_lib.ATTENTION_IMPLEMENTATIONS.items():
            if not implementation.supports(mask, "float32", 0.0):
                continue
            got = keras.ops.convert_to_numpy(implementation.attend(q, k, v, mask, 0.5, no_dropout))
            assert np.all(np.isfinite(got)), f"{name} on {kind}"
            np.testing.assert_allclose(
                got[specified], want[specified], atol=1e-5, err_msg=f"{name} on {kind}"
            )
            checked.add(name)
    backend = keras.backend.backend()
    expected = {"explicit", "keras", "banded"}
    expected |= {"torch-sdpa", "torch-flex"} if backend == "torch" else set()
    assert checked >= expected


def test_the_layer_reports_and_follows_its_choice():
    x = np.random.default_rng(2).normal(size=(2, 5, 8)).astype("float32")
    padding = np.array([[1] * 5, [1] * 3 + [0] * 2], "int32")
    auto = MultiHeadSelfAttention(2, 8, attention_dropout=0.0)
    out = keras.ops.convert_to_numpy(auto(x, padding))
    assert auto.attention_path(False) == (
        "torch-sdpa" if keras.backend.backend() == "torch" else "keras"
    )
    causal = AttentionMask(padding=padding, causal=True)
    explicit = MultiHeadSelfAttention.from_config(
        {**auto.get_config(), "attention_implementation": "explicit"}
    )
    explicit(x, padding)
    explicit.set_weights(auto.get_weights())
    assert explicit.attention_path(False) == "explicit"
    np.testing.assert_allclose(keras.ops.convert_to_numpy(explicit(x, padding)), out, atol=1e-5)
    # a causal description changes what the padded rows see
    causal_out = keras.ops.convert_to_numpy(auto(x, attention_mask=causal))
    assert np.abs(causal_out[0, :4] - out[0, :4]).max() > 1e-4
    np.testing.assert_allclose(causal_out[0, 4], out[0, 4], atol=1e-5)  # last row sees all


def test_a_named_implementation_that_cannot_take_the_call_is_refused():
    with pytest.raises(ValueError, match="unknown attention_implementation 'flash3'"):
        MultiHeadSelfAttention(2, 8, attention_implementation="flash3")
    layer = MultiHeadSelfAttention(2, 8, attention_dropout=0.1, attention_implementation="keras")
    with pytest.raises(ValueError, match="cannot compute this call"):
        layer.attention_path(training=True)  # keras' kernel takes no dropout


def test_a_dense_mask_is_refused_with_the_description_to_use():
    layer = MultiHeadSelfAttention(2, 8)
    with pytest.raises(ValueError, match="AttentionMask"):
        layer(np.ones((1, 3, 8), "float32"), np.ones((1, 3, 3), "int32"))


def test_a_registered_implementation_plugs_in_by_name():
    """A new kind is one `register_attention` call: a block built with its
    name runs it (here "explicit"'s computation, counted)."""
    calls = []

    def counted(query, key, value, mask, scale, dropout):
        calls.append(mask.kind)
        return attention_lib._explicit(query, key, value, mask, scale, dropout)

    attention_lib.register_attention("counted", counted, lambda mask, dtype, rate: True)
    try:
        block = TransformerEncoderBlock(2, 8, 16, attention_implementation="counted")
        x = np.ones((1, 4, 8), "float32")
        block(x, attention_mask=AttentionMask(padding=np.ones((1, 4), "int32"), window=1))
        assert calls and calls[-1] == "general"
        config = block.get_config()
        assert config["attention_implementation"] == "counted"
        assert TransformerEncoderBlock.from_config(config).attention_implementation == "counted"
    finally:
        del attention_lib.ATTENTION_IMPLEMENTATIONS["counted"]
