"""CPU inference paths: `predict_on_batch` cut to the batch's longest row
where a backend runs any length without compiling it, and the int8
quantizer and rescaling of `kbert.backend.ops` equal to Keras' forms."""

import contextlib

import keras
import numpy as np
import pytest

import kbert
from kbert import backend as kbert_backend
from kbert.backend import ops as fused
from kbert.training import batching
from tests.harness import TINY


def inference():
    """No autograd on torch (the inference paths), nothing elsewhere."""
    if kbert_backend.is_torch():
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


def test_length_groups_cut_one_group_to_its_longest_row_at_multiple_one():
    mask = (np.arange(32) < np.array([3, 9, 5, 1])[:, None]).astype("int32")
    x = {"token_ids": mask.copy(), "segment_ids": 0 * mask, "padding_mask": mask}
    assert [(list(r), n) for r, n in batching.length_groups(x, 1, 64, split=False)] == [
        ([0, 1, 2, 3], 9)
    ]
    # a compiling backend's multiple keeps the batch's own bucket (no new shape)
    assert [n for _, n in batching.length_groups(x, 16, 64, split=False)] == [32]


def test_predict_on_batch_of_raw_text_runs_at_the_longest_rows_bucket(monkeypatch):
    """Raw text padded to the preprocessor's `sequence_length` reaches the
    model cut to its longest row's bucket on every backend (on eager torch
    on a CPU: the longest row itself), with the outputs of the full-length
    batch."""
    keras.utils.set_random_seed(2)
    backbone = kbert.BertBackbone(**{**TINY, "max_sequence_length": 64}, dropout=0.0)
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c"]
    preprocessor = kbert.BertPreprocessor(kbert.BertTokenizer(vocabulary), sequence_length=64)
    model = kbert.BertClassifier(backbone, 2, preprocessor=preprocessor, dropout=0.0)
    texts = ["a b", "a b c a", "c"]
    full = preprocessor(texts)
    assert np.shape(full["padding_mask"]) == (3, 64)
    widths = []
    take_rows = batching.take_rows
    monkeypatch.setattr(
        batching,
        "take_rows",
        lambda x, rows, length, *a: widths.append(length) or take_rows(x, rows, length, *a),
    )
    out = model.predict_on_batch(texts)
    longest = 6  # [CLS] a b c a [SEP]
    multiple = batching.batch_multiple(model)
    if kbert_backend.is_torch() and not kbert_backend.on_accelerator():
        # small batches replay a trace per bucket (kbert.backend.torch_trace)
        assert multiple == batching.MULTIPLE
        assert batching.default_multiple(model) == 1
    expected = batching.bucket_length(longest, 64, multiple)
    if (
        batching.splits_batches(model)
        or multiple == 1
        or kbert_backend.trainer.traces_inference(model)
    ):
        assert max(widths) == expected < 64
    reference = keras.ops.convert_to_numpy(model(full, training=False))
    np.testing.assert_allclose(out, reference, atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 24), (2, 5, 16), (2, 7)])
def test_int8_quantize_gives_keras_abs_max_integers_and_scale(shape):
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape).astype("float32")
    x *= rng.uniform(1e-3, 1e3, size=shape[:-1] + (1,)).astype("float32")
    x.reshape(-1, shape[-1])[0] = 0.0  # a row of zeros
    x.reshape(-1, shape[-1])[-1, 0] = -x.reshape(-1, shape[-1])[-1].__abs__().max() * 2
    epsilon = keras.config.epsilon()
    with inference():
        values, scale = fused.int8_quantize(x, (-127, 127), epsilon)
    ref_values, ref_scale = keras.quantizers.abs_max_quantize(
        keras.ops.convert_to_tensor(x), axis=-1, value_range=(-127, 127), epsilon=epsilon
    )
    assert keras.backend.standardize_dtype(values.dtype) == "int8"
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(values), keras.ops.convert_to_numpy(ref_values)
    )
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(scale), keras.ops.convert_to_numpy(ref_scale)
    )
    assert np.abs(keras.ops.convert_to_numpy(values)).max() == 127


@pytest.mark.parametrize("with_bias", [True, False])
def test_int8_dequantize_is_keras_rescaling_bit_for_bit(with_bias):
    rng = np.random.default_rng(1)
    product = rng.integers(-(2**20), 2**20, size=(2, 5, 6)).astype("int32")
    kernel_scale = rng.uniform(1, 300, size=(6,)).astype("float32")
    inputs_scale = rng.uniform(0.1, 90, size=(2, 5, 1)).astype("float32")
    bias = rng.normal(size=(6,)).astype("float32") if with_bias else None
    with inference():
        out = fused.int8_dequantize(product, kernel_scale, inputs_scale, bias, "float32")
    ops = keras.ops
    expected = ops.divide(
        ops.cast(product, "float32"), ops.multiply(kernel_scale, inputs_scale)
    )  # Keras' int8 Dense
    if bias is not None:
        expected = ops.add(expected, bias)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    np.testing.assert_array_equal(ops.convert_to_numpy(out), ops.convert_to_numpy(expected))
