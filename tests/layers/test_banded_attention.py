""" "banded" attention: exact against "explicit" on random masks (window,
padding, global tokens, segments, causal; lengths that are not a multiple
of the block), memory linear in length, and the window description."""

import keras
import numpy as np
import pytest

from kbert.layers import AttentionMask
from kbert.layers import attention as attention_lib
from kbert.layers.banded_attention import banded_attention, check_window, window_mask
from tests.layers.test_attention import reference_mask

NO_DROPOUT = attention_lib.AttentionDropout(0.0, None)


def _random_case(rng, length, window, glob, segments, causal):
    batch = 2
    padding = (rng.random((batch, length)) < 0.7).astype("int32")
    parts = dict(padding=padding, window=window, causal=causal)
    rules = dict(window=window, causal=causal)
    if glob:
        g = (rng.random((batch, length)) < 0.2).astype("int32")
        g[0, 0] = 1
        parts["global_tokens"], rules["glob"] = g, g
    if segments:
        s = rng.integers(1, 3, (batch, length)).astype("int32")
        parts["segments"], rules["segments"] = s, s
    return parts, rules


def _both(parts, q, k, v):
    """("banded", "explicit") outputs for the mask `parts`; one compiled
    program on JAX (op by op, each new shape compiles every op)."""
    tensors = {
        name: parts[name] for name in ("padding", "global_tokens", "segments") if name in parts
    }
    static = {name: parts[name] for name in ("window", "causal") if name in parts}
    if "global_tokens" in parts:
        static["max_global"] = max(1, int(parts["global_tokens"].sum(1).max()))

    def run(q, k, v, tensors):
        mask = AttentionMask(**tensors, **static)
        explicit = attention_lib.ATTENTION_IMPLEMENTATIONS["explicit"]
        return (
            banded_attention(q, k, v, mask, 0.5, NO_DROPOUT),
            explicit.attend(q, k, v, mask, 0.5, NO_DROPOUT),
        )

    if keras.backend.backend() == "jax":
        import jax

        run = jax.jit(run)
    return [keras.ops.convert_to_numpy(x) for x in run(q, k, v, tensors)]


@pytest.mark.parametrize(
    "length,window,segments,causal",
    [(13, 3, True, False), (16, 4, False, True), (5, 9, True, False), (9, 0, False, False)],
)
def test_banded_equals_explicit_on_random_masks(length, window, segments, causal):
    """T not a multiple of the block (13, 9), a window wider than the row
    (5 with 9), a window of 0 (global tokens only), with and without global
    tokens; compared on the queries that see some key (the others are
    padding: unspecified outputs, finite here)."""
    rng = np.random.default_rng(length * 10 + window)
    for glob in (False, True):
        parts, rules = _random_case(rng, length, window, glob, segments, causal)
        q, k, v = (rng.normal(size=(2, length, 2, 4)).astype("float32") for _ in range(3))
        mask = AttentionMask(**parts)
        assert attention_lib.select_implementation("auto", mask, "float32", 0.0).name == "banded"
        got, want = _both(parts, q, k, v)
        rows = _reference(parts["padding"], length, rules).any(-1)
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got[rows], want[rows], atol=1e-5, err_msg=str(parts))


def _reference(padding, length, rules):
    from tests.layers import test_attention

    saved = test_attention.T
    test_attention.T = length  # the reference is written for the module's T
    try:
        return reference_mask(padding, **rules, fallback=False)
    finally:
        test_attention.T = saved


def test_global_slots_must_be_static_inside_a_trace():
    padding = np.ones((1, 8), "int32")
    glob = np.zeros((1, 8), "int32")
    glob[0, :2] = 1
    mask = AttentionMask(padding=padding, window=1, global_tokens=glob, max_global=2)
    assert attention_lib.ATTENTION_IMPLEMENTATIONS["banded"].supports(mask, "float32", 0.0)
    assert not attention_lib.ATTENTION_IMPLEMENTATIONS["banded"].supports(
        AttentionMask(padding=padding), "float32", 0.0
    )  # no window: the dense kernels take it
    with pytest.raises(ValueError, match="max_global"):
        AttentionMask(padding=padding, window=1, max_global=0)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="reads the traced program")
def test_memory_is_linear_in_length():
    """No intermediate of the traced program holds T^2 scores per head:
    the largest is the band, 3 C per query."""
    import jax

    length, window, heads = 256, 8, 2
    q = np.zeros((1, length, heads, 4), "float32")
    padding = np.ones((1, length), "int32")

    def run(q, padding):
        mask = window_mask(padding, 2 * window, 1)
        return banded_attention(q, q, q, mask, 0.5, NO_DROPOUT)

    program = jax.make_jaxpr(run)(q, padding)
    sizes = [
        int(np.prod(v.aval.shape))
        for eqn in program.jaxpr.eqns
        for v in eqn.outvars
        if hasattr(v.aval, "shape")
    ]
    assert max(sizes) <= heads * length * (3 * window + 1)
    assert max(sizes) < length * length


def test_window_mask_and_its_checks():
    padding = np.array([[1, 1, 1, 1, 0, 0]], "int32")
    mask = window_mask(padding, 4, 2)
    assert (mask.window, mask.max_global) == (2, 2)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(mask.global_tokens), [[1, 1, 0, 0, 0, 0]]
    )
    dense = keras.ops.convert_to_numpy(mask.dense(6, 6))[0]
    assert dense[3].tolist() == [True, True, True, True, False, False]
    # row 5 (padding query): the two global keys, key 3 in its window, not key 2
    assert dense[5].tolist() == [True, True, False, True, False, False]
    with pytest.raises(ValueError, match="attention_window"):
        check_window(3, 1)
    with pytest.raises(ValueError, match="global_tokens"):
        check_window(4, -1)
    # the separator rules name what they need
    with pytest.raises(ValueError, match="separator_token_id"):
        check_window(4, "before_separator", 8)
    with pytest.raises(ValueError, match="max_global_tokens"):
        check_window(4, "after_separators", None, separator_token_id=2)
    with pytest.raises(ValueError, match="separator_token_id must be"):
        check_window(4, 1, separator_token_id=-2)
    check_window(4, "before_separator", 8, separator_token_id=0)  # accepted
    # `<s> q q </s></s> c </s> pad`: the question, then the ending
    ids = np.array([[0, 5, 6, 2, 2, 7, 2, 1]], "int32")
    padding = (ids != 1).astype("int32")
    for rule, want in [
        ("before_separator", [1, 1, 1, 0, 0, 0, 0, 0]),
        ("after_separators", [0, 0, 0, 0, 0, 1, 1, 0]),
    ]:
        mask = window_mask(padding, 4, rule, max_global=4, token_ids=ids, separator_id=2)
        got = keras.ops.convert_to_numpy(mask.global_tokens)[0].tolist()
        assert got == want, rule
    with pytest.raises(ValueError, match="separator id"):
        window_mask(padding, 4, "before_separator", max_global=4, token_ids=ids)
