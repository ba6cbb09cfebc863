import math

import keras
import numpy as np
import pytest

import kbert
from kbert.models.pretrainer import masked_lm_loss, next_sentence_loss
from tests import harness
from tests.harness import TINY, max_abs_diff


def batch(seed=0, batch_size=4, length=12, predictions=3, vocabulary_size=97):
    rng = np.random.default_rng(seed)
    x = harness.backbone_inputs(batch_size, length, vocabulary_size, seed)
    x["mask_positions"] = rng.integers(1, 4, (batch_size, predictions)).astype("int32")
    weights = np.ones((batch_size, predictions), "float32")
    weights[1, 2:] = 0
    weights[2] = 0  # a row whose prediction slots are all padding
    y = {
        "mask_ids": (rng.integers(1, vocabulary_size, (batch_size, predictions)) * weights).astype(
            "int32"
        ),
        "mask_weights": weights,
        "next_sentence_labels": rng.integers(0, 2, (batch_size,)).astype("int32"),
    }
    return x, y


def test_losses_against_hand_computed_values():
    logits = np.log(
        np.array(
            [[[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]], [[1 / 3, 1 / 3, 1 / 3], [0.5, 0.25, 0.25]]],
            "float32",
        )
    )
    ids = np.array([[0, 2], [1, 0]], "int32")
    weights = np.array([[1, 1], [0, 0]], "float32")  # second row: padding only
    expected = (-math.log(0.7) - math.log(0.8)) / (2 + 1e-5)
    got = float(keras.ops.convert_to_numpy(masked_lm_loss(ids, logits, weights)))
    assert abs(got - expected) < 1e-6
    no_predictions = float(
        keras.ops.convert_to_numpy(masked_lm_loss(ids, logits, np.zeros((2, 2), "float32")))
    )
    assert no_predictions == 0.0
    nsp_logits = np.log(np.array([[0.9, 0.1], [0.4, 0.6]], "float32"))
    got = float(keras.ops.convert_to_numpy(next_sentence_loss(np.array([0, 1]), nsp_logits)))
    assert abs(got - (-math.log(0.9) - math.log(0.6)) / 2) < 1e-6


@pytest.fixture
def model():
    return kbert.BertPreTrainer(kbert.BertBackbone(**TINY))


def test_outputs_and_tied_decoder(model):
    x, _ = batch()
    y = model(x)
    assert tuple(y["mlm_logits"].shape) == (4, 3, TINY["vocabulary_size"])
    assert tuple(y["nsp_logits"].shape) == (4, 2)
    head_paths = model.head_weight_paths()
    assert not any("decoder" in p for p in head_paths)  # tied to the token embedding
    # logits = transform(h) @ E^T + b, with E the backbone's token embedding
    seq = model.backbone(x)["sequence_output"]
    head = model.get_layer("mlm_head")
    gathered = keras.ops.take_along_axis(
        seq, keras.ops.expand_dims(x["mask_positions"], -1), axis=1
    )
    h = head.layer_norm(head.transform(gathered))
    expected = (
        keras.ops.matmul(h, keras.ops.transpose(model.backbone.token_embedding.embeddings))
        + head.output_bias
    )
    assert max_abs_diff(expected, y["mlm_logits"]) < 1e-5


def test_fit_reports_metrics_and_is_finite_with_padding_rows(model):
    x, y = batch()
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    history = model.fit(x, y, epochs=2, verbose=0).history
    for key in ("loss", "mlm_loss", "mlm_accuracy", "nsp_loss", "nsp_accuracy"):
        assert key in history and all(np.isfinite(history[key]))
    assert history["loss"][1] < history["loss"][0]
    # each metric (and so each metric variable of the train state) once
    assert len(model.metrics) == len({id(m) for m in model.metrics}) == 5
    assert len(model.metrics_variables) == len({id(v) for v in model.metrics_variables})


def test_missing_targets_raise(model):
    x, y = batch()
    model.compile(optimizer="adamw")
    del y["next_sentence_labels"]
    with pytest.raises(ValueError, match="next_sentence_labels"):
        model.fit(x, y, epochs=1, verbose=0)


def test_round_trips(model, tmp_path):
    x, y = batch()
    harness.check_config_round_trip(model)
    harness.check_keras_round_trip(model, x, tmp_path)
    directory = harness.check_preset_round_trip(model, x, tmp_path)
    # the backbone alone loads from a task preset
    backbone = kbert.BertBackbone.from_preset(directory)
    assert max_abs_diff(backbone(x), model.backbone(x)) == 0.0


def test_masked_lm_only(tmp_path):
    model = kbert.BertMaskedLM(kbert.BertBackbone(**TINY))
    x, y = batch()
    assert set(model(x)) == {"mlm_logits"}
    model.compile(optimizer="adamw")
    history = model.fit(
        x, {k: y[k] for k in ("mask_ids", "mask_weights")}, epochs=1, verbose=0
    ).history
    assert "nsp_loss" not in history and np.isfinite(history["mlm_loss"][0])
    harness.check_keras_round_trip(model, x, tmp_path)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_training(policy):
    if policy == "mixed_float16" and keras.backend.backend() == "jax":
        pytest.skip("float16 matmuls are not supported by XLA:CPU's dot")
    model = kbert.BertPreTrainer(kbert.BertBackbone(**TINY, dtype=policy))
    x, y = batch()
    out = model(x)
    assert keras.backend.standardize_dtype(out["mlm_logits"].dtype) == "float32"
    model.compile(optimizer="adamw")
    if policy == "mixed_float16":
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    history = model.fit(x, y, epochs=1, verbose=0).history
    assert np.isfinite(history["loss"][0])
