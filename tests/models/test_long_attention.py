"""Backbones and tasks with sliding-window + global attention
(`attention_window`): the same outputs as the dense masked reference, packed
rows, fit, predict, save/load and export."""

import keras
import numpy as np
import pytest

import kbert
from tests import harness
from tests.harness import TINY

CONFIG = {
    **TINY,
    "num_layers": 1,
    "max_sequence_length": 40,
    "dropout": 0.0,
    "attention_dropout": 0.0,
}
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "the a movie was good bad".split()


def _twin(backbone, **changes):
    twin = kbert.BertBackbone.from_config({**backbone.get_config(), **changes})
    twin.set_weights(backbone.get_weights())
    return twin


def test_windowed_backbone_equals_the_dense_reference():
    banded = kbert.BertBackbone(**CONFIG, attention_window=6, global_tokens=2)
    x = harness.backbone_inputs(batch=3, length=37, vocabulary_size=97)  # 37: not a block multiple
    real = x["padding_mask"][..., None]

    def outputs(model):  # compiled: one program per model, not one per op
        y = model.predict(x, batch_size=3, verbose=0)
        return y["sequence_output"] * real, y["pooled_output"]

    got = outputs(banded)
    want = outputs(_twin(banded, attention_implementation="explicit"))
    assert harness.max_abs_diff(got, want) <= 1e-5
    # a window is a different model from full attention...
    full = outputs(_twin(banded, attention_window=None))
    assert np.max(np.abs(full[0] - got[0])) > 1e-3


def test_windowed_backbone_config_and_keras_round_trip(tmp_path):
    backbone = kbert.BertBackbone(**CONFIG, attention_window=4)
    config = harness.check_config_round_trip(backbone).get_config()
    assert (config["attention_window"], config["global_tokens"]) == (4, 1)
    assert "attention_window" not in kbert.BertBackbone(**CONFIG).get_config()
    x = harness.backbone_inputs(batch=2, length=12, vocabulary_size=97)
    harness.check_keras_round_trip(backbone, x, tmp_path)
    with pytest.raises(ValueError, match="attention_window"):
        kbert.BertBackbone(**CONFIG, attention_window=5)


def test_windowed_classifier_fits_predicts_and_round_trips(tmp_path):
    backbone = kbert.BertBackbone(**{**CONFIG, "vocabulary_size": len(VOCAB)}, attention_window=4)
    preprocessor = kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), sequence_length=40)
    model = kbert.BertClassifier(backbone, 2, preprocessor=preprocessor)
    texts = ["the movie was good " * 6, "the movie was bad " * 7, "good", "bad bad"]
    labels = np.array([1, 0, 1, 0])
    model.compile(learning_rate=1e-3)
    history = model.fit(texts, labels, batch_size=4, epochs=1, verbose=0).history
    assert np.isfinite(history["loss"]).all()
    before = model.predict(texts, verbose=0)
    model.save_to_preset(tmp_path / "preset")
    again = kbert.BertClassifier.from_preset(tmp_path / "preset")
    assert again.backbone.attention_window == 4
    np.testing.assert_allclose(again.predict(texts, verbose=0), before, atol=1e-5)
    # a full-attention preset, loaded longer and windowed
    full = kbert.BertClassifier.from_preset(
        tmp_path / "preset", attention_window=None, max_sequence_length=80
    )
    assert full.backbone.attention_window is None and full.preprocessor.sequence_length == 80


def test_packed_rows_with_a_window_give_each_example_its_own_outputs():
    """Rows holding several examples: the window stays inside each example
    and each example's [CLS] is global (its position 0)."""
    from kbert.training import batching
    from tests.models.test_packing import inputs

    backbone = kbert.BertBackbone(**{**CONFIG, "max_sequence_length": 32}, attention_window=4)
    model = kbert.BertClassifier(backbone, 3, dropout=0.0)
    x = inputs(n=8)
    alone = model.predict_on_batch(x)
    data = batching.PackedBatches(x, np.zeros(8, "int32"), batch_size=8, row_length=32)
    batch, _ = data[0]
    assert batch["token_ids"].shape[0] < 8  # examples side by side
    packed = keras.ops.convert_to_numpy(model(batch, training=False))
    np.testing.assert_allclose(packed, alone[data.batches[0]], atol=1e-5)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="a SavedModel, once")
def test_windowed_backbone_exports_a_saved_model(tmp_path):
    import tensorflow as tf

    backbone = kbert.BertBackbone(**CONFIG, attention_window=6)
    backbone.export(str(tmp_path / "saved"), verbose=0)
    x = harness.backbone_inputs(batch=2, length=37, vocabulary_size=97)
    loaded = tf.saved_model.load(str(tmp_path / "saved"))  # kept: serve uses its variables
    served = loaded.serve({k: tf.constant(v) for k, v in x.items()})
    want = harness.to_numpy(backbone(x))
    real = x["padding_mask"][..., None]
    got = served["sequence_output"].numpy()
    assert np.max(np.abs((got - want["sequence_output"]) * real)) <= 1e-5


def test_global_projections_start_as_copies_of_the_local_ones(tmp_path):
    """Longformer's conversion: a BERT loaded with `global_projections=True`
    gives the same outputs until the global projections are trained; they
    then change the global tokens' outputs only (one block: the others see
    global keys through the local projections)."""
    backbone = kbert.BertBackbone(**CONFIG, attention_window=6, global_tokens=2)
    backbone.save_to_preset(tmp_path / "preset")
    x = harness.backbone_inputs(batch=3, length=37, vocabulary_size=97)
    real = x["padding_mask"][..., None]
    local = keras.ops.convert_to_numpy(backbone(x)["sequence_output"]) * real
    both = kbert.BertBackbone.from_preset(tmp_path / "preset", global_projections=True)
    assert both.get_config()["global_projections"]
    out = keras.ops.convert_to_numpy(both(x)["sequence_output"]) * real
    assert harness.max_abs_diff(out, local) <= 1e-6
    attention = both.transformer_layers[0].self_attention
    kernel = attention.global_key_value.kernel
    kernel.assign(np.random.default_rng(0).normal(size=kernel.shape).astype("float32"))
    moved = keras.ops.convert_to_numpy(both(x)["sequence_output"]) * real
    assert np.abs(moved[:, :2] - local[:, :2]).max() > 1e-3
    assert harness.max_abs_diff(moved[:, 2:], local[:, 2:]) <= 1e-6
    harness.check_config_round_trip(both)
    harness.check_keras_round_trip(both, x, tmp_path)
    with pytest.raises(ValueError, match="attention_window"):
        kbert.BertBackbone(**CONFIG, global_projections=True)


def test_global_attention_mask_replaces_the_rule():
    """A `global_attention_mask` input equals the `global_tokens` rule when
    it marks the same tokens, and a full-attention backbone refuses one."""
    backbone = kbert.BertBackbone(**CONFIG, attention_window=6, global_tokens=2)
    x = harness.backbone_inputs(batch=3, length=37, vocabulary_size=97)
    real = x["padding_mask"][..., None]
    rule = keras.ops.convert_to_numpy(backbone(x)["sequence_output"]) * real
    first_two = np.zeros_like(x["token_ids"])
    first_two[:, :2] = 1
    given = backbone({**x, "global_attention_mask": first_two})
    assert (
        harness.max_abs_diff(keras.ops.convert_to_numpy(given["sequence_output"]) * real, rule)
        <= 1e-6
    )
    other = first_two.copy()
    other[:, 1], other[:, 20] = 0, 1
    moved = keras.ops.convert_to_numpy(
        backbone({**x, "global_attention_mask": other})["sequence_output"]
    )
    assert np.abs(moved * real - rule).max() > 1e-3
    with pytest.raises(ValueError, match="attention_window"):
        kbert.BertBackbone(**CONFIG)({**x, "global_attention_mask": first_two})


def test_first_segment_rule_makes_the_question_global():
    """`global_tokens="first_segment"`: the tokens of segment 0 (padding
    never), at most `max_global_tokens` of them per row; and a question
    answerer asked for a window gets it."""
    backbone = kbert.BertBackbone(
        **CONFIG, attention_window=6, global_tokens="first_segment", max_global_tokens=5
    )
    x = harness.backbone_inputs(batch=3, length=37, vocabulary_size=97)
    x["segment_ids"] = np.zeros_like(x["segment_ids"])
    x["segment_ids"][:, 4:] = 1  # a 4-token first segment
    real = x["padding_mask"][..., None]
    rule = keras.ops.convert_to_numpy(backbone(x)["sequence_output"]) * real
    first = ((x["segment_ids"] == 0) & (x["padding_mask"] == 1)).astype("int32")
    given = backbone({**x, "global_attention_mask": first})["sequence_output"]
    assert harness.max_abs_diff(keras.ops.convert_to_numpy(given) * real, rule) <= 1e-6
    predicted = backbone.predict(x, batch_size=3, verbose=0)["sequence_output"] * real
    assert harness.max_abs_diff(predicted, rule) <= 1e-5
    dense = _twin(backbone, attention_implementation="explicit")
    assert harness.max_abs_diff(dense.predict(x, verbose=0)["sequence_output"] * real, rule) <= 1e-5
    # a longer first segment keeps its first 5 tokens global
    x["segment_ids"][:, 4:9] = 0
    capped = keras.ops.convert_to_numpy(backbone(x)["sequence_output"]) * real
    first = ((x["segment_ids"] == 0) & (x["padding_mask"] == 1)).astype("int32")
    first[:, 5:] = 0
    given = backbone({**x, "global_attention_mask": first})["sequence_output"]
    assert harness.max_abs_diff(keras.ops.convert_to_numpy(given) * real, capped) <= 1e-6
    with pytest.raises(ValueError, match="max_global_tokens"):
        kbert.BertBackbone(**CONFIG, attention_window=6, global_tokens="first_segment")


def test_windowed_question_answerer_makes_its_question_global(tmp_path):
    kbert.BertBackbone(**{**CONFIG, "vocabulary_size": len(VOCAB)}).save_to_preset(
        tmp_path / "preset", kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), 40)
    )
    qa = kbert.BertQuestionAnswerer.from_preset(
        tmp_path / "preset", attention_window=4, max_query_length=6
    )
    config = qa.backbone.get_config()
    assert (config["global_tokens"], config["max_global_tokens"]) == ("first_segment", 8)
    answers = qa.predict_answers(["was the movie good"], ["the movie was good " * 5])
    assert len(answers) == 1 and isinstance(answers[0], str)
    classifier = kbert.BertClassifier.from_preset(
        tmp_path / "preset", num_classes=2, attention_window=4
    )
    assert classifier.backbone.get_config()["global_tokens"] == 1
