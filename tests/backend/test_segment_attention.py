"""torch: a training step's attention over variable-length segments
(`torch_ops.segment_attention`), used where the batch's padding trails its
real tokens and its losses read no padding output
(`torch_step.segments_apply`, checked on the host)."""

import keras
import numpy as np
import pytest

import kbert
from tests.harness import TINY

pytestmark = pytest.mark.skipif(keras.backend.backend() != "torch", reason="the torch step")


def _cuda():
    import torch

    return keras.backend.backend() == "torch" and torch.cuda.is_available()


def _mask(lengths, length, left=False):
    mask = (np.arange(length)[None] < np.asarray(lengths)[:, None]).astype("int32")
    return mask[:, ::-1].copy() if left else mask


def test_segments_apply_where_padding_trails_and_reaches_no_loss(monkeypatch):
    import torch

    from kbert.backend import torch_ddp, torch_ops, torch_step

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    length = torch_ops.SEGMENT_MIN_LENGTH
    applies = torch_step.segments_apply

    def batch(mask, y=None, sample_weight=None):
        y = np.zeros(len(mask)) if y is None else y
        return {"token_ids": np.ones_like(mask), "padding_mask": mask}, y, sample_weight

    right = _mask([length, 5, 0], length)
    assert applies(batch(right))
    assert applies(batch(right.astype(bool)))
    assert applies(batch(torch.from_numpy(right)))
    assert applies(batch(np.stack([right, right])))  # multiple choice (B, C, T)
    assert applies(batch(right)[0])  # x alone
    assert applies(list(batch(right)[:2]))  # as Keras' torch loop gives it

    assert not applies(batch(_mask([length, 5, 3], length, left=True)))
    holed = right.copy()
    holed[1, 2] = 0
    assert not applies(batch(holed))
    assert not applies(batch(_mask([3, 2], length - 16)))  # below SEGMENT_MIN_LENGTH
    assert not applies(({"token_ids": right}, None, None))
    assert not applies(right)  # no dict, no mask

    # targets per token: only where every padding position weighs 0
    tags = np.ones_like(right)
    assert not applies(batch(right, tags))
    assert applies(batch(right, tags, right.astype("float32")))
    assert applies(batch(right, {"tags": tags}, {"tags": right * 0.5}))
    leaky = right.astype("float32")
    leaky[1, -1] = 1.0
    assert not applies(batch(right, tags, leaky))
    assert not applies(batch(right, tags, np.ones(len(right))))  # per-example weights
    assert not applies(batch(right, tags[..., None] * np.ones(3)))  # (B, T, C) targets

    monkeypatch.setattr(torch_ddp, "active", lambda: True)
    assert not applies(batch(right))
    monkeypatch.setattr(torch_ddp, "active", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not applies(batch(right))


def test_segment_bounds_cover_each_rows_real_tokens_then_its_padding():
    import torch

    from kbert.backend import torch_ops

    length, chunk = 300, torch_ops.SEGMENT_CHUNK
    lengths = [300, 10, 0, 129]
    bounds = torch_ops._segment_bounds(torch.from_numpy(_mask(lengths, length)), length).tolist()
    per_row = 1 + -(-length // chunk)
    assert len(bounds) == len(lengths) * per_row + 1
    assert bounds[0] == 0 and bounds[-1] == len(lengths) * length
    for row, real in enumerate(lengths):
        edges = bounds[row * per_row : (row + 1) * per_row + 1]
        assert edges[0] == row * length and edges[-1] == (row + 1) * length
        # the real tokens, one segment; a row without any is one segment,
        # as the masked attention lets it attend to every key
        assert edges[1] - edges[0] == (real or length)
        sizes = np.diff(edges[1:])
        assert (sizes >= 0).all() and (sizes <= chunk).all()


@pytest.mark.skipif(_cuda(), reason="Keras puts the tensors on the GPU")
def test_segment_attention_is_not_used_off_a_gpu():
    import torch

    from kbert.backend import torch_ops

    q, k, v = (torch.randn(2, 160, 2, 8) for _ in range(3))
    mask = torch.from_numpy(_mask([160, 40], 160))
    keep = mask.bool()[:, None, None, :]
    reference = torch_ops.sdpa(q, k, v, keep, 0.35)
    with torch_ops.segment_attention():
        out = torch_ops.sdpa(q, k, v, keep, 0.35, padding_mask=mask)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)


def _count_segment_calls(monkeypatch):
    from kbert.backend import torch_ops

    calls = []
    original = torch_ops._segment_sdpa

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch_ops, "_segment_sdpa", counted)
    return calls


@pytest.mark.skipif(not _cuda(), reason="FlashAttention: torch on a GPU")
def test_segment_attention_equals_masked_attention_at_real_tokens(monkeypatch):
    """The layer's output at real tokens (and at every position of a row
    without any) and every gradient (the upstream gradient zero at padding,
    as the losses that allow segments make it) equal the masked
    attention's, to bfloat16 rounding."""
    import torch

    from kbert.backend import torch_ops
    from kbert.layers.attention import MultiHeadSelfAttention

    calls = _count_segment_calls(monkeypatch)
    length = 160
    layer = MultiHeadSelfAttention(
        num_heads=4, hidden_dim=64, attention_dropout=0.0, dtype="mixed_bfloat16"
    )
    layer.build((None, length, 64))
    rng = np.random.default_rng(0)
    mask = torch.from_numpy(_mask([160, 90, 1, 0], length)).cuda()
    seen = (mask.bool() | ~mask.bool().any(1, keepdim=True))[:, :, None].float()
    x0 = torch.from_numpy(rng.standard_normal((4, length, 64)).astype("float32")).cuda()
    upstream = torch.from_numpy(rng.standard_normal((4, length, 64)).astype("float32")).cuda()

    def run(segments):
        x = x0.clone().requires_grad_()
        weights = [v.value for v in layer.trainable_variables]
        for w in weights:
            w.grad = None
        with torch_ops.segment_attention(segments):
            y = layer(x, mask, training=True)
        (y.float() * upstream * seen).sum().backward()
        return y.float() * seen, [x.grad] + [w.grad.clone() for w in weights]

    out, grads = run(True)
    assert len(calls) == 1
    ref, ref_grads = run(False)
    assert len(calls) == 1
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads, ref_grads):
        scale = float(b.abs().max())
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=3e-2 * scale)


def _rows(length, rows, left=False):
    lengths = np.random.default_rng(1).integers(1, length + 1, rows)
    lengths[::2] = length  # each batch of 2 as long as the rows: one length bucket
    mask = _mask(lengths, length, left)
    ids = np.random.default_rng(2).integers(1, 97, mask.shape)
    return {
        "token_ids": (ids * mask).astype("int32"),
        "segment_ids": np.zeros_like(mask),
        "padding_mask": mask,
    }


def _backbone(length):
    keras.utils.set_random_seed(5)
    config = {**TINY, "max_sequence_length": length, "dropout": 0.0, "attention_dropout": 0.0}
    return kbert.BertBackbone(**config, dtype="mixed_bfloat16")


@pytest.mark.skipif(not _cuda(), reason="FlashAttention: torch on a GPU")
def test_graphed_fit_runs_segment_attention_only_where_padding_trails(monkeypatch):
    """fit (length buckets, as by default) with rows of 160 tokens replays
    a step with segments, and trains as the masked one (dropout 0,
    bfloat16); batches padded on the left train with the masked attention."""
    from kbert.backend import torch_ops

    calls = _count_segment_calls(monkeypatch)
    length, rows = 160, 8

    def fit(x, min_length):
        monkeypatch.setattr(torch_ops, "SEGMENT_MIN_LENGTH", min_length)
        model = kbert.BertClassifier(_backbone(length), num_classes=2)
        model.compile(learning_rate=1e-3)
        y = np.arange(rows) % 2
        history = model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
        return model, history.history["loss"]

    segmented, loss = fit(_rows(length, rows), length)
    # 2 epochs of 4 batches: 1 eager warm-up step, the captured one, 6 replays
    assert segmented.cuda_graph_stats["replays"] == 7
    assert calls and all(shape[1] == length for shape in calls)
    del calls[:]
    masked, reference = fit(_rows(length, rows), length + 1)
    assert not calls
    np.testing.assert_allclose(loss, reference, rtol=2e-2)

    left, _ = fit(_rows(length, rows, left=True), length)
    assert not calls
    assert left.cuda_graph_stats["replays"] == 7


@pytest.mark.skipif(not _cuda(), reason="FlashAttention: torch on a GPU")
def test_segment_attention_trains_as_the_masked_attention(monkeypatch):
    """With plain gradient descent (the weights' changes are sums of the
    gradients) a fit with segments changes the weights as the masked fit,
    to bfloat16 rounding."""
    from kbert.backend import torch_ops

    calls = _count_segment_calls(monkeypatch)
    length, rows = 160, 8
    changes = []
    for min_length in (length, length + 1):
        monkeypatch.setattr(torch_ops, "SEGMENT_MIN_LENGTH", min_length)
        model = kbert.BertClassifier(_backbone(length), num_classes=2)
        model.compile(optimizer=keras.optimizers.SGD(0.5))
        before = model.get_weights()
        model.fit(_rows(length, rows), np.arange(rows) % 2, batch_size=2, shuffle=False, verbose=0)
        changes.append([a - b for a, b in zip(model.get_weights(), before)])
        assert bool(calls) == (min_length == length)
        del calls[:]
    difference = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(*changes)))
    size = np.sqrt(sum(np.sum(b**2) for b in changes[1]))
    assert size > 0 and difference < 0.05 * size


@pytest.mark.skipif(not _cuda(), reason="FlashAttention: torch on a GPU")
def test_token_targets_without_weights_keep_the_masked_attention(monkeypatch):
    """Per-token labels without sample weights put every padding position
    in the loss: that fit keeps the masked attention; weighted 0 at padding,
    it runs segments."""
    calls = _count_segment_calls(monkeypatch)
    length, rows = 160, 8
    x = _rows(length, rows)
    tags = np.random.default_rng(3).integers(0, 3, (rows, length))
    for weights in (None, x["padding_mask"].astype("float32")):
        model = kbert.BertTokenClassifier(_backbone(length), num_classes=3)
        model.compile(learning_rate=1e-3)
        model.fit(x, tags, sample_weight=weights, batch_size=2, shuffle=False, verbose=0)
        assert bool(calls) == (weights is not None)
        del calls[:]
