"""keras-hub BERT preset directories -> kbert, exact against keras-hub's own forward pass."""

import json

import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

import kbert
from kbert.presets import PresetError
from tests import harness

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "the cat sat on a mat dog ran ##s".split()


@pytest.fixture
def keras_hub_preset(tmp_path):
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=60,
        num_layers=2,
        num_heads=4,
        hidden_dim=32,
        intermediate_dim=37,
        max_sequence_length=24,
    )
    directory = tmp_path / "keras_hub_bert"
    backbone.save_to_preset(str(directory))
    keras_hub.models.BertTokenizer(vocabulary=VOCAB, lowercase=True).save_to_preset(str(directory))
    return backbone, directory


def test_keras_hub_backbone_matches_keras_hub(keras_hub_preset):
    theirs, directory = keras_hub_preset
    ours = kbert.BertBackbone.from_preset(directory)
    assert ours.activation == "gelu_tanh" and ours.num_layers == 2
    x = harness.backbone_inputs(batch=3, length=10, vocabulary_size=60)
    reference = theirs(
        {
            "token_ids": x["token_ids"],
            "segment_ids": x["segment_ids"],
            "padding_mask": x["padding_mask"],
        }
    )
    out = harness.to_numpy(ours(x))
    mask = x["padding_mask"][..., None]
    assert (
        np.max(
            np.abs((out["sequence_output"] - harness.to_numpy(reference["sequence_output"])) * mask)
        )
        <= 1e-5
    )
    assert (
        np.max(np.abs(out["pooled_output"] - harness.to_numpy(reference["pooled_output"]))) <= 1e-5
    )


def test_keras_hub_preset_gives_task_and_tokenizer(keras_hub_preset, tmp_path):
    _, directory = keras_hub_preset
    model = kbert.BertClassifier.from_preset(directory, num_classes=2)
    assert model.preprocessor is not None and model.preprocessor.tokenizer.lowercase
    tokenizer = keras_hub.models.BertTokenizer.from_preset(str(directory))
    text = "The cat sat on the mats"
    assert model.preprocessor.tokenizer.tokenize(text) == [
        int(i) for i in np.asarray(tokenizer(text))
    ]
    assert model.predict(["the cat sat"], verbose=0).shape == (1, 2)
    model.backbone.save_to_preset(tmp_path / "converted")  # and on into a kbert preset
    again = kbert.BertBackbone.from_preset(tmp_path / "converted")
    x = harness.backbone_inputs(batch=2, length=8, vocabulary_size=60)
    assert harness.max_abs_diff(again(x), model.backbone(x)) == 0.0


def test_keras_hub_preset_of_another_model_or_broken_weights(keras_hub_preset):
    _, directory = keras_hub_preset
    config = json.loads((directory / "config.json").read_text())
    config["registered_name"] = "keras_hub>GPT2Backbone"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(PresetError, match="not a BERT backbone"):
        kbert.BertBackbone.from_preset(directory)
    config["registered_name"] = "keras_hub>BertBackbone"
    (directory / "config.json").write_text(json.dumps(config))
    data = (directory / "model.weights.h5").read_bytes()
    (directory / "model.weights.h5").write_bytes(data[: len(data) // 3])
    with pytest.raises(PresetError, match="model.weights.h5"):
        kbert.BertBackbone.from_preset(directory)
