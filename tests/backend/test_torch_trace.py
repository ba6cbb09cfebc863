"""Small inference batches on torch on a CPU replay TorchScript traces
(`kbert.backend.torch_trace`): the eager forward's outputs, weights read
in place, traces dropped when the model's variables are other tensors,
and an eager fallback with a warning where a trace cannot stand for the
forward."""

import copy
import warnings

import keras
import numpy as np
import pytest

import kbert
from kbert import backend as kbert_backend
from kbert.training import batching
from tests.harness import TINY

pytestmark = pytest.mark.skipif(
    not kbert_backend.is_torch(), reason="TorchScript traces are the torch backend's"
)

VOCABULARY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c", "d"]
TEXTS = ["a b", "a b c a", "c", "d d a b c"]


def classifier(**backbone_kwargs):
    keras.utils.set_random_seed(3)
    backbone = kbert.BertBackbone(**{**TINY, **backbone_kwargs}, dropout=0.0)
    preprocessor = kbert.BertPreprocessor(kbert.BertTokenizer(VOCABULARY), sequence_length=24)
    return kbert.BertClassifier(backbone, 3, preprocessor=preprocessor, dropout=0.0)


def eager(model, texts):
    setting = model.trace_inference
    model.trace_inference = False
    try:
        return np.asarray(model.predict_on_batch(texts))
    finally:
        model.trace_inference = setting


def stats(model):
    return model.__dict__["_traced_forward"].stats()


def test_second_call_of_a_shape_replays_a_trace_with_the_eager_outputs():
    model = classifier()
    first = np.asarray(model.predict_on_batch(["a b"]))
    assert stats(model)["replays"] == 0  # a shape's first call runs eagerly
    assert stats(model)["eager_calls"] == 1
    # every text of TEXTS is one row at the bucket of 16 positions: one trace
    again = [np.asarray(model.predict_on_batch([t])) for t in TEXTS]
    assert stats(model)["recorded"] == 1
    assert stats(model)["replays"] >= len(TEXTS)
    np.testing.assert_array_equal(again[0], first)  # eager and traced: the same bits
    for out, text in zip(again, TEXTS):
        np.testing.assert_allclose(out, eager(model, [text]), atol=1e-6)
    # a batch of several rows is its own signature
    for _ in range(2):
        np.testing.assert_allclose(model.predict_on_batch(TEXTS), eager(model, TEXTS), atol=1e-5)
    assert stats(model)["recorded"] == 2
    # a deep copy starts without traces (its weights are other tensors)
    clone = copy.deepcopy(model)
    copied = clone.__dict__.get("_traced_forward")
    assert (copied is None or copied.stats()["traces"] == 0) and stats(model)["traces"] == 2
    np.testing.assert_array_equal(clone.predict_on_batch(["a b"]), first)
    # a whole predict() runs eagerly: no recording, no replay
    before = stats(model)
    np.testing.assert_allclose(
        model.predict(TEXTS * 4, batch_size=2, verbose=0), eager(model, TEXTS * 4), atol=1e-5
    )
    after = stats(model)
    assert (after["recorded"], after["replays"]) == (before["recorded"], before["replays"])


def test_in_place_weight_changes_reach_the_trace_and_new_variables_drop_it():
    model = classifier()
    for _ in range(3):
        before = np.asarray(model.predict_on_batch(["a b c"]))
    assert stats(model)["replays"] >= 1
    # set_weights assigns in place: the trace reads the new values
    model.set_weights([w * 0.5 for w in model.get_weights()])
    after = np.asarray(model.predict_on_batch(["a b c"]))
    assert not np.allclose(after, before, atol=1e-4)
    np.testing.assert_allclose(after, eager(model, ["a b c"]), atol=1e-6)
    assert stats(model)["recorded"] == 1
    # fit updates the same tensors
    model.compile(learning_rate=1e-2)
    model.fit(["a b c", "d a"], np.array([0, 2]), epochs=2, verbose=0)
    np.testing.assert_allclose(
        model.predict_on_batch(["a b c"]), eager(model, ["a b c"]), atol=1e-6
    )
    # LoRA adds variables and changes the forward: the traces are dropped
    dense = [
        layer
        for layer in model._flatten_layers()
        if isinstance(layer, keras.layers.Dense) and layer.built and layer.kernel.ndim == 2
    ][-1]
    plain = np.asarray(model.predict_on_batch(["a b c"]))
    dense.enable_lora(2)
    dense.lora_kernel_b.assign(np.full(dense.lora_kernel_b.shape, 0.3, "float32"))
    lora = np.asarray(model.predict_on_batch(["a b c"]))
    assert stats(model)["traces"] == 0
    np.testing.assert_allclose(lora, eager(model, ["a b c"]), atol=1e-6)
    assert not np.allclose(lora, plain, atol=1e-4)


class ValueDependent(kbert.BertClassifier):
    """A forward that decides on the host from its inputs' values: the
    number of valid tokens picks the output's scale."""

    def call(self, inputs, training=None):
        logits = super().call(inputs, training=training)
        valid = int(keras.ops.convert_to_numpy(keras.ops.sum(inputs["padding_mask"])))
        return logits * float(valid)


def test_a_forward_that_reads_values_on_the_host_warns_and_runs_eagerly():
    base = classifier()
    model = ValueDependent(base.backbone, 3, preprocessor=base.preprocessor, dropout=0.0)
    model.trace_inference = True  # a user's call: "auto" would not trace it
    expected = [eager(model, [t]) for t in TEXTS]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [np.asarray(model.predict_on_batch([t])) for t in TEXTS for _ in range(2)]
    assert any("could not be traced" in str(w.message) for w in caught)
    assert stats(model)["failed"]
    for i, text in enumerate(TEXTS):
        np.testing.assert_allclose(got[2 * i], expected[i], atol=1e-6)
        np.testing.assert_allclose(got[2 * i + 1], expected[i], atol=1e-6)
    # given up: eager buckets again (the longest row itself)
    assert batching.batch_multiple(model) == batching.default_multiple(model)


def test_what_is_not_traced():
    auto_user_call = ValueDependent(classifier().backbone, 3)
    assert not kbert_backend.trainer.traces_inference(auto_user_call)  # "auto": a user's call
    windowed = classifier(attention_window=4)
    assert not kbert_backend.trainer.traces_inference(windowed)
    model = classifier()
    assert kbert_backend.trainer.traces_inference(model)
    model.trace_inference = False
    assert not kbert_backend.trainer.traces_inference(model)
    # a batch of more than MAX_TRACED_TOKENS positions runs eagerly
    model = classifier()
    texts = ["a b c d a b c d a b c d"] * 20  # 20 rows x 16 > 256
    for _ in range(3):
        out = model.predict_on_batch(texts)
    assert stats(model)["recorded"] == 0
    np.testing.assert_allclose(out, eager(model, texts), atol=1e-5)
