import json

import pytest

import kbert
from kbert.presets import PresetError
from tests.harness import TINY


@pytest.fixture
def saved(tmp_path):
    model = kbert.BertBackbone(**TINY)
    directory = tmp_path / "preset"
    model.save_to_preset(directory)
    return model, directory


def test_metadata_checksums_every_file(saved):
    _, directory = saved
    metadata = json.loads((directory / "metadata.json").read_text())
    assert set(metadata["files"]) == {"config.json", "model.safetensors"}
    assert metadata["kbert_version"] == kbert.__version__


def test_not_a_preset_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(PresetError, match="is not a preset"):
        kbert.BertBackbone.from_preset(tmp_path)


def test_missing_directory(tmp_path):
    with pytest.raises(PresetError, match="does not exist"):
        kbert.BertBackbone.from_preset(str(tmp_path / "nope"))


def test_unknown_registered_name():
    with pytest.raises(ValueError, match="did you mean 'bert_base_en_uncased'"):
        kbert.BertBackbone.from_preset("bert_base_en_uncase")


def test_other_model_type_in_huggingface_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "roberta", "vocab_size": 10}))
    with pytest.raises(PresetError, match="'roberta' model"):
        kbert.BertBackbone.from_preset(tmp_path)


def test_other_class_in_kbert_preset(saved):
    _, directory = saved
    config = json.loads((directory / "config.json").read_text())
    config["class_name"] = "GPT2Backbone"
    (directory / "config.json").write_text(json.dumps(config))
    # Re-checksum so that the class check, not the checksum, is what refuses it.
    metadata = json.loads((directory / "metadata.json").read_text())
    import hashlib

    metadata["files"]["config.json"] = hashlib.sha256(
        (directory / "config.json").read_bytes()
    ).hexdigest()
    (directory / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(PresetError, match="GPT2Backbone"):
        kbert.BertBackbone.from_preset(directory)


def test_modified_weights_fail_checksum(saved):
    _, directory = saved
    data = bytearray((directory / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (directory / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(PresetError, match="checksum"):
        kbert.BertBackbone.from_preset(directory)


def test_shape_mismatch_is_reported(saved, tmp_path):
    _, directory = saved
    other = kbert.BertBackbone(**{**TINY, "intermediate_dim": 40})
    from kbert.presets.io import load_weights_file
    from kbert.presets.weights import assign_weights

    with pytest.raises(ValueError, match="shape mismatch"):
        assign_weights(other, load_weights_file(directory, "model.safetensors"))


def test_list_presets():
    presets = kbert.presets.list_presets()
    assert "bert_base_en_uncased" in presets and all(isinstance(v, str) for v in presets.values())
