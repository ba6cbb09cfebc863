import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import kbert
from tests import harness
from tests.harness import TINY, backbone_inputs, max_abs_diff


@pytest.fixture
def backbone():
    return kbert.BertBackbone(**TINY)


@pytest.fixture
def x():
    return backbone_inputs()


def test_import_does_not_import_tensorflow():
    code = "import sys, kbert; assert 'tensorflow' not in sys.modules, 'tensorflow imported'"
    env = dict(os.environ, KERAS_BACKEND="jax")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_output_names_and_shapes(backbone, x):
    y = backbone(x)
    assert set(y) == {"sequence_output", "pooled_output"}
    assert tuple(y["sequence_output"].shape) == (3, 10, 32)
    assert tuple(y["pooled_output"].shape) == (3, 32)


def test_config_round_trip(backbone, x):
    clone = harness.check_config_round_trip(backbone)
    assert clone.count_params() == backbone.count_params()


def test_eager_vs_compiled(backbone, x):
    harness.check_eager_vs_compiled(backbone, x)


def test_fit_one_step_changes_weights(x):
    model = kbert.BertBackbone(**TINY, dropout=0.1, attention_dropout=0.1)
    before = keras.ops.convert_to_numpy(model.token_embedding.embeddings).copy()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss={"pooled_output": "mse"})
    history = model.fit(x, {"pooled_output": np.ones((3, 32), "float32")}, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    after = keras.ops.convert_to_numpy(model.token_embedding.embeddings)
    assert not np.allclose(before, after)


def test_keras_round_trip(backbone, x, tmp_path):
    harness.check_keras_round_trip(backbone, x, tmp_path)


def test_keras_artifact_loads_under_other_backends(backbone, x, tmp_path):
    artifact = harness.check_keras_round_trip(backbone, x, tmp_path)
    inputs_path = str(tmp_path / "inputs.npz")
    np.savez(inputs_path, **x)
    expected = keras.tree.flatten(harness.to_numpy(backbone(x)))
    for other in harness.BACKENDS:
        if other == keras.backend.backend():
            continue
        got = harness.load_in_backend(other, artifact, inputs_path, str(tmp_path / f"{other}.npz"))
        assert len(got) == len(expected)
        real = x["padding_mask"][..., None] > 0  # padding positions: each backend's own
        for a, b in zip(got, expected):
            if a.ndim == 3:  # sequence_output
                a, b = np.where(real, a, 0), np.where(real, b, 0)
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_preset_round_trip(backbone, x, tmp_path):
    directory = harness.check_preset_round_trip(backbone, x, tmp_path)
    assert sorted(os.listdir(directory)) == ["config.json", "metadata.json", "model.safetensors"]


def test_preset_overrides_and_no_weights(backbone, x, tmp_path):
    backbone.save_to_preset(tmp_path / "p")
    fresh = kbert.BertBackbone.from_preset(tmp_path / "p", load_weights=False, dropout=0.0)
    assert fresh.dropout == 0.0
    assert max_abs_diff(fresh(x), backbone(x)) > 1e-3


def test_hidden_states(x):
    model = kbert.BertBackbone(**TINY, output_hidden_states=True)
    y = model(x)
    states = keras.ops.convert_to_numpy(y["hidden_states"])
    assert states.shape == (3, TINY["num_layers"] + 1, 10, 32)
    np.testing.assert_array_equal(states[:, -1], keras.ops.convert_to_numpy(y["sequence_output"]))


def test_padding_does_not_change_real_tokens(backbone):
    x = backbone_inputs(batch=1, length=6)
    padded = {k: np.pad(v, ((0, 0), (0, 4))) for k, v in x.items()}
    short = keras.ops.convert_to_numpy(backbone(x)["sequence_output"])
    long = keras.ops.convert_to_numpy(backbone(padded)["sequence_output"])[:, :6]
    np.testing.assert_allclose(short, long, atol=1e-5)


def test_all_padding_row_is_finite(backbone):
    x = backbone_inputs()
    x["padding_mask"][1] = 0
    for value in harness.to_numpy(backbone(x)).values():
        assert np.all(np.isfinite(value))


@pytest.mark.parametrize("call", ["call", "predict"])
def test_token_id_out_of_range_raises(backbone, x, call):
    x["token_ids"][0, 3] = TINY["vocabulary_size"]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        backbone(x) if call == "call" else backbone.predict(x, verbose=0)


def test_negative_token_id_raises(backbone, x):
    x["token_ids"][0, 0] = -1
    with pytest.raises(ValueError, match="outside the vocabulary"):
        backbone(x)


def test_segment_id_out_of_range_raises(backbone, x):
    x["segment_ids"][0, 0] = 2
    with pytest.raises(ValueError, match="segment_ids"):
        backbone(x)


@pytest.mark.parametrize("call", ["call", "predict"])
def test_sequence_longer_than_maximum_raises(backbone, call):
    x = backbone_inputs(batch=2, length=TINY["max_sequence_length"] + 1)
    with pytest.raises(ValueError, match="max_sequence_length"):
        backbone(x) if call == "call" else backbone.predict(x, verbose=0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden_dim=30), "divisible"),
        (dict(num_layers=0), "num_layers"),
        (dict(activation="gelu_fancy"), "unknown activation"),
        (dict(dropout=1.5), "dropout"),
    ],
)
def test_bad_config_raises(overrides, message):
    with pytest.raises(ValueError, match=message):
        kbert.BertBackbone(**{**TINY, **overrides})


def test_mixed_precision(x):
    model = kbert.BertBackbone(**TINY, dtype="mixed_bfloat16")
    y = model(x)
    assert keras.backend.standardize_dtype(y["sequence_output"].dtype) == "bfloat16"
    assert all(keras.backend.standardize_dtype(w.dtype) == "float32" for w in model.weights)
    assert np.all(np.isfinite(harness.to_numpy(y)["sequence_output"].astype("float32")))
    restored = kbert.BertBackbone.from_config(model.get_config())
    assert keras.backend.standardize_dtype(restored(x)["sequence_output"].dtype) == "bfloat16"


def _count(config):
    """Parameters of a BERT backbone, from the paper's architecture."""
    v, h, i, p, s, layers = (
        config[k]
        for k in (
            "vocabulary_size",
            "hidden_dim",
            "intermediate_dim",
            "max_sequence_length",
            "type_vocab_size",
            "num_layers",
        )
    )
    embeddings = (v + p + s) * h + 2 * h
    block = 4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h
    return embeddings + layers * block + h * h + h


def test_architectures():
    tiny = kbert.BertBackbone.from_architecture("bert_tiny")
    assert (tiny.num_layers, tiny.hidden_dim, tiny.num_heads, tiny.intermediate_dim) == (
        2,
        128,
        2,
        512,
    )
    assert tiny.count_params() == _count(tiny.get_config())
    sizes = {
        name: _count(kbert.presets.architecture_config(name))
        for name in kbert.presets.ARCHITECTURES
    }
    assert 108e6 < sizes["bert_base"] < 111e6  # "110M" in the paper
    assert 333e6 < sizes["bert_large"] < 336e6  # "340M"
    assert kbert.presets.architecture_config("bert_large")["num_heads"] == 16
    with pytest.raises(ValueError, match="bert_base"):
        kbert.BertBackbone.from_architecture("bert_bse")
