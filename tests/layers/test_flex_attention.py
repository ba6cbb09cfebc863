""" "torch-flex" attention (torch's FlexAttention): exact against "explicit"
on random masks, forward and gradient, attention dropout as probability
dropout, the block structure it skips by, its place in "auto" and its
refusals. The kernel runs on torch only; the selection tests run on every
backend."""

import keras
import numpy as np
import pytest

import kbert
from kbert.backend import ops as kernels
from kbert.layers import AttentionMask, MultiHeadSelfAttention
from kbert.layers import attention as attention_lib
from tests import harness
from tests.harness import TINY

on_torch = pytest.mark.skipif(keras.backend.backend() != "torch", reason="FlexAttention is torch's")
NO_DROPOUT = attention_lib.AttentionDropout(0.0, None)


def rules(parts, length):
    """(B, T, T) bool from the rules of `kbert.layers.masks`, vectorised,
    without the fallback for queries that see nothing."""
    t = np.arange(length)[:, None]
    s = np.arange(length)[None, :]
    local = np.ones((1, length, length), bool)
    if parts.get("causal"):
        before = (s <= t)[None]
        if parts.get("prefix_lengths") is not None:
            before = before | (s[None] < parts["prefix_lengths"][:, None, None])
        local = local & before
    if parts.get("window") is not None:
        local = local & (np.abs(t - s) <= parts["window"])[None]
    if parts.get("global_tokens") is not None:
        g = parts["global_tokens"].astype(bool)
        local = local | g[:, :, None] | g[:, None, :]
    ok = local & parts["padding"].astype(bool)[:, None, :]
    if parts.get("segments") is not None:
        seg = parts["segments"]
        ok = ok & (seg[:, :, None] == seg[:, None, :])
    return ok


def random_parts(rng, length, window=None, glob=False, segments=False, causal=False, full=False):
    batch = 2
    padding = np.ones((batch, length), "int32") if full else rng.random((batch, length)) < 0.8
    parts = dict(padding=np.asarray(padding, "int32"), window=window, causal=causal)
    if glob:
        g = (rng.random((batch, length)) < 0.05).astype("int32")
        g[:, 0] = 1
        parts["global_tokens"] = g
    if segments:
        parts["segments"] = np.sort(rng.integers(0, 3, (batch, length)), axis=1).astype("int32")
    if causal and rng.random() < 0.5:
        parts["prefix_lengths"] = rng.integers(0, length, batch).astype("int32")
    return parts


CASES = {
    "window": dict(length=13, window=3),
    "window-global": dict(length=150, window=20, glob=True),
    "window-global-full-blocks": dict(length=300, window=130, glob=True, full=True),
    "window-segments": dict(length=140, window=30, glob=True, segments=True),
    "causal-window": dict(length=140, window=40, causal=True),
    "causal-prefix": dict(length=20, causal=True),
    "padding": dict(length=9),
    "window-zero": dict(length=9, window=0, glob=True),
}


def _qkv(rng, length, grad=False):
    import torch

    return [
        torch.tensor(rng.normal(size=(2, length, 2, 4)).astype("float32"), requires_grad=grad)
        for _ in range(3)
    ]


@on_torch
@pytest.mark.parametrize("case", list(CASES))
def test_flex_equals_explicit_on_random_masks(case):
    """Lengths below, at and across FlexAttention's 128-token blocks;
    compared on the queries that see some key (the others are padding:
    unspecified outputs, zeros here)."""
    rng = np.random.default_rng(len(case))
    parts = random_parts(rng, **CASES[case])
    mask = AttentionMask(**parts)
    q, k, v = _qkv(rng, CASES[case]["length"])
    flex = attention_lib.ATTENTION_IMPLEMENTATIONS["torch-flex"]
    explicit = attention_lib.ATTENTION_IMPLEMENTATIONS["explicit"]
    got = keras.ops.convert_to_numpy(flex.attend(q, k, v, mask, 0.5, NO_DROPOUT))
    want = keras.ops.convert_to_numpy(explicit.attend(q, k, v, mask, 0.5, NO_DROPOUT))
    rows = rules(parts, CASES[case]["length"]).any(-1)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[rows], want[rows], atol=1e-5, err_msg=case)


@on_torch
def test_flex_takes_queries_and_keys_of_different_lengths():
    """Cross-attention (padding of the other sequence's keys) and cached
    decoding (causal: the queries are the last T of the S positions)."""
    import torch

    rng = np.random.default_rng(4)
    q = torch.tensor(rng.normal(size=(2, 5, 2, 4)).astype("float32"))
    k, v = (torch.tensor(rng.normal(size=(2, 140, 2, 4)).astype("float32")) for _ in range(2))
    padding = (np.arange(140)[None] < np.array([[140], [70]])).astype("int32")
    flex = attention_lib.ATTENTION_IMPLEMENTATIONS["torch-flex"]
    explicit = attention_lib.ATTENTION_IMPLEMENTATIONS["explicit"]
    for mask in (
        AttentionMask(padding=padding),
        AttentionMask(padding=padding, causal=True),
        AttentionMask(padding=padding, causal=True, window=80),  # every query sees a key
    ):
        got = keras.ops.convert_to_numpy(flex.attend(q, k, v, mask, 0.5, NO_DROPOUT))
        want = keras.ops.convert_to_numpy(explicit.attend(q, k, v, mask, 0.5, NO_DROPOUT))
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=repr(mask))


@pytest.fixture
def cpu_backward(monkeypatch):
    """torch refuses FlexAttention's backward on a CPU in the public
    function; its reference implementation has one, which these tests use
    to check the gradients of kbert's rule and dropout (a GPU runs the
    compiled kernels' backward)."""
    from torch.nn.attention import flex_attention

    monkeypatch.setattr(flex_attention, "_validate_device", lambda *args: None)


def _grads(output, inputs, weights):
    import torch

    return torch.autograd.grad((output.cpu() * weights).sum(), inputs)


@on_torch
@pytest.mark.parametrize("case", ["window-global", "window-segments", "causal-window"])
def test_flex_gradients_equal_explicit(case, cpu_backward):
    import torch

    rng = np.random.default_rng(7)
    parts = random_parts(rng, **CASES[case])
    length = CASES[case]["length"]
    mask = AttentionMask(**parts)
    inputs = _qkv(rng, length, grad=True)
    rows = torch.tensor(rules(parts, length).any(-1))[:, :, None, None]
    weights = torch.tensor(rng.normal(size=(2, length, 2, 4)).astype("float32")) * rows
    flex = attention_lib.ATTENTION_IMPLEMENTATIONS["torch-flex"]
    explicit = attention_lib.ATTENTION_IMPLEMENTATIONS["explicit"]
    got = _grads(flex.attend(*inputs, mask, 0.5, NO_DROPOUT), inputs, weights)
    want = _grads(explicit.attend(*inputs, mask, 0.5, NO_DROPOUT), inputs, weights)
    for name, a, b in zip("qkv", got, want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5, err_msg=f"d{name} {case}")


@on_torch
def test_flex_dropout_is_dropout_on_the_probabilities(cpu_backward):
    """Output and gradients equal softmax, then the kept probabilities
    scaled by 1 / (1 - p), with the keep pattern the kernel's hash gives
    (rebuilt here from the same seed); the keep rate is 1 - p."""
    import torch

    from kbert.backend import torch_flex

    rng = np.random.default_rng(3)
    length, rate = 150, 0.25
    parts = random_parts(rng, length, window=20, glob=True)
    mask = AttentionMask(**parts)
    inputs = _qkv(rng, length, grad=True)
    torch.manual_seed(11)
    got = torch_flex.attention(*inputs, mask, 0.5, dropout=rate)
    torch.manual_seed(11)  # the seed the call drew, on its device
    seed = torch.randint(0, 1 << 30, (), dtype=torch.int32, device=got.device).cpu()
    got = got.cpu()
    index = torch.meshgrid(*(torch.arange(n) for n in (2, 2, length, length)), indexing="ij")
    keep = torch_flex._keep_mod(seed, rate)(torch.zeros(2, 2, length, length), *index) == 0
    assert abs(float(keep.float().mean()) - (1 - rate)) < 0.01
    flat = keep.float()
    for a, b in [  # neighbouring keys, queries, heads, rows: independent draws
        (flat[..., 1:], flat[..., :-1]),
        (flat[:, :, 1:], flat[:, :, :-1]),
        (flat[:, 1], flat[:, 0]),
        (flat[1], flat[0]),
    ]:
        assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 0.03
    q, k, v = inputs
    allowed = torch.tensor(rules(parts, length))[:, None]  # (B, 1, T, S)
    scores = torch.einsum("btnd,bsnd->bnts", q, k) * 0.5
    probs = torch.softmax(scores.masked_fill(~allowed, -1e30), -1) * keep / (1 - rate)
    want = torch.einsum("bnts,bsnd->btnd", probs, v)
    rows = allowed.any(-1)[:, 0][:, :, None, None]  # (B, T, 1, 1)
    np.testing.assert_allclose((got * rows).detach(), (want * rows).detach(), atol=1e-5)
    weights = torch.tensor(rng.normal(size=(2, length, 2, 4)).astype("float32")) * rows
    for a, b in zip(_grads(got, inputs, weights), _grads(want, inputs, weights)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)


@on_torch
@pytest.mark.parametrize("case", list(CASES))
def test_the_block_structure_covers_the_mask(case):
    """Every 128 x 128 tile holding a visible pair is partial or full, a
    full tile has every pair visible, and no tile is both."""
    from kbert.backend import torch_flex

    rng = np.random.default_rng(5)
    parts = random_parts(rng, **CASES[case])
    length = CASES[case]["length"]
    mask = AttentionMask(**parts)
    structure = torch_flex.MaskParts(mask, 2, length, length, "cpu")
    partial, full = (x[:, 0].numpy() for x in torch_flex.block_structure(structure, 2, "cpu"))
    dense = rules(parts, length)
    blocks = -(-length // torch_flex.BLOCK)
    size = blocks * torch_flex.BLOCK
    tiles = np.zeros((2, size, size), bool)
    tiles[:, :length, :length] = dense
    tiles = tiles.reshape(2, blocks, torch_flex.BLOCK, blocks, torch_flex.BLOCK)
    visible_any, visible_all = tiles.any((2, 4)), tiles.all((2, 4))
    assert not np.any(partial & full)
    assert np.all(partial | full | ~visible_any)
    assert np.all(visible_all | ~full)
    if case == "window-global-full-blocks":
        assert full.any()


@on_torch
def test_a_window_visits_a_band_of_tiles():
    """Memory and work linear in length: with a window of 64 and [CLS]
    global, each block of queries other than the first visits at most its
    neighbours and the first block."""
    from kbert.backend import torch_flex

    length = 16 * torch_flex.BLOCK
    mask = kbert.layers.banded_attention.window_mask(np.ones((1, length), "int32"), 128, 1)
    structure = torch_flex.MaskParts(mask, 1, length, length, "cpu")
    partial, full = torch_flex.block_structure(structure, 1, "cpu")
    visited = (partial | full)[0, 0].sum(-1).numpy()
    assert visited[0] == 16 and visited[1:].max() <= 4


def test_auto_takes_flex_for_windowed_masks_where_it_is_preferred(monkeypatch):
    padding = np.ones((1, 8), "int32")
    windowed = AttentionMask(padding=padding, window=2)
    plain = AttentionMask(padding=padding)
    torch = keras.backend.backend() == "torch"
    select = attention_lib.select_implementation
    # on a CPU "banded" stays first for windows
    if not kernels.flex_attention_preferred():
        assert select("auto", windowed, "float32", 0.0).name == "banded"
    monkeypatch.setattr(kernels, "flex_attention_preferred", lambda: True)  # as on a GPU
    assert select("auto", windowed, "float32", 0.0).name == ("torch-flex" if torch else "banded")
    assert select("auto", windowed, "float32", 0.1).name == ("torch-flex" if torch else "banded")
    assert select("auto", plain, "float32", 0.0).name == ("torch-sdpa" if torch else "keras")


def test_flex_is_refused_off_torch_and_for_training_on_a_cpu():
    layer = MultiHeadSelfAttention(
        2, 8, attention_dropout=0.0, attention_implementation="torch-flex"
    )
    x = np.random.default_rng(0).normal(size=(1, 6, 8)).astype("float32")
    mask = AttentionMask(padding=np.ones((1, 6), "int32"), window=1)
    if keras.backend.backend() != "torch":
        with pytest.raises(ValueError, match="cannot compute this call on the"):
            layer(x, attention_mask=mask)
        return
    assert layer.attention_path(attention_mask=mask) == "torch-flex"
    if kernels.flex_attention_preferred():
        return  # a GPU trains through it (below)
    with pytest.raises(ValueError, match="cannot train on a CPU"):
        layer(x, attention_mask=mask)  # the weights need gradients


# two heads of 16: the size the compiled kernel takes without padding
CONFIG = {**TINY, "num_heads": 2, "max_sequence_length": 300, "dropout": 0.0}


def _twin(backbone, **changes):
    twin = kbert.BertBackbone.from_config({**backbone.get_config(), **changes})
    twin.set_weights(backbone.get_weights())
    return twin


@on_torch
def test_a_windowed_backbone_predicts_through_flex():
    """A backbone built with "torch-flex" predicts what "explicit" does
    (inference: no gradients, so a CPU runs it too), across blocks."""
    flex = kbert.BertBackbone(
        **CONFIG, attention_dropout=0.0, attention_window=40, attention_implementation="torch-flex"
    )
    x = harness.backbone_inputs(batch=2, length=260, vocabulary_size=97)
    real = x["padding_mask"][..., None]

    def outputs(model):
        y = model.predict(x, batch_size=2, verbose=0)
        return y["sequence_output"] * real, y["pooled_output"]

    got = outputs(flex)
    assert (
        harness.max_abs_diff(got, outputs(_twin(flex, attention_implementation="explicit"))) <= 1e-5
    )


@on_torch
@pytest.mark.parametrize("attention_dropout", [0.0, 0.1])
def test_a_windowed_classifier_fits_through_flex(attention_dropout, cpu_backward, monkeypatch):
    """fit through "torch-flex", taken by "auto" as on a GPU. On a GPU the
    step is captured as a CUDA graph (compilation happens in the eager
    warm-up step) and the loss falls, with attention dropout too (two kernel
    calls); on a CPU (torch's reference backward, slow: it traces the rule
    per call) one epoch without dropout gives a finite loss."""
    gpu = kernels.flex_attention_preferred()
    if attention_dropout and not gpu:
        pytest.skip("a GPU: the reference backward is slow")
    monkeypatch.setattr(kernels, "flex_attention_preferred", lambda: True)
    backbone = kbert.BertBackbone(
        **{**CONFIG, "num_layers": 1}, attention_dropout=attention_dropout, attention_window=40
    )
    layer = backbone.transformer_layers[0].self_attention
    mask = kbert.layers.banded_attention.window_mask(np.ones((1, 140), "int32"), 40, 1)
    assert layer.attention_path(training=True, attention_mask=mask) == "torch-flex"
    model = kbert.BertClassifier(backbone, 2)
    model.compile(learning_rate=3e-3)
    x = harness.backbone_inputs(batch=4, length=140, vocabulary_size=97)
    y = (x["token_ids"][:, 1] % 2).astype("int32")
    history = model.fit(x, y, batch_size=4, epochs=6 if gpu else 1, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)), losses
    if gpu:
        assert losses[-1] < losses[0], losses
        assert model.cuda_graph_stats["capture_failed"] is None, model.cuda_graph_stats
        assert model.cuda_graph_stats["replays"] > 0, model.cuda_graph_stats
