"""`kbert.presets.loader_for`: one format decision per directory, and the
tables the Hugging Face converter reads and writes with."""

import os

import numpy as np
import pytest

import kbert
from kbert.convert import huggingface
from kbert.presets import PresetError, PresetLoader, loader, loader_for, register_format
from tests.harness import TINY


def test_formats_are_asked_in_priority_order():
    assert loader.formats() == [
        "keras_hub",
        "tf_checkpoint",
        "huggingface-encoder-decoder",  # before the BERT format, which takes any model_type
        "huggingface-longformer",
        "huggingface-mobilebert",
        "huggingface",
        "kbert",
    ]


def test_each_directory_gets_its_format(tmp_path):
    backbone = kbert.BertBackbone(**TINY)
    backbone.save_to_preset(tmp_path / "kbert")
    huggingface.export_to_huggingface(backbone, tmp_path / "hf")
    assert loader_for(tmp_path / "kbert").format == "kbert"
    assert loader_for(tmp_path / "hf").format == "huggingface"
    for name in ("kbert", "hf"):
        config, weights = loader_for(tmp_path / name).read_backbone()
        assert config["num_layers"] == TINY["num_layers"]
        expected = {v.path: v.numpy() for v in backbone.weights}
        assert weights.keys() == expected.keys()
        for path, value in expected.items():
            np.testing.assert_allclose(weights[path], value, rtol=0, atol=0)


def test_unknown_directory(tmp_path):
    with pytest.raises(PresetError, match="is not a preset"):
        loader_for(tmp_path)
    assert loader_for(tmp_path, required=False) is None


def test_a_registered_format_is_detected(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "_FORMATS", list(loader._FORMATS))

    class MarkerLoader(PresetLoader):
        format = "marker"
        priority = 0

        @classmethod
        def detect(cls, directory):
            return os.path.exists(os.path.join(directory, "marker"))

    register_format(MarkerLoader)
    assert loader.formats()[0] == "marker"
    assert loader_for(tmp_path, required=False) is None
    (tmp_path / "marker").write_text("")
    assert isinstance(loader_for(tmp_path), MarkerLoader)


def test_every_class_and_architecture_maps_both_ways():
    for name, task in huggingface.TASKS.items():
        for albert in (False, True):
            arch = huggingface.architecture(task, albert)
            held = huggingface.CLASS_OF_ARCHITECTURE[arch]
            # BertTextEmbedder is written as BertModel, which loads as a backbone
            assert held == name or huggingface.TASKS[held] == task
    assert huggingface.CLASS_OF_ARCHITECTURE["BertModel"] == "BertBackbone"
    assert huggingface.CLASS_OF_ARCHITECTURE["AlbertForPreTraining"] == "BertPreTrainer"


@pytest.mark.parametrize("style", ["bert", "albert"])
def test_head_tables_read_what_they_write(style):
    rng = np.random.default_rng(0)
    for head, table in huggingface.HEADS[style].items():
        ours = {
            path: rng.standard_normal((3, 2) if path.endswith("/kernel") else (2,))
            for _, path, _ in huggingface.tensors(table)
        }
        written = huggingface.write_table(table, ours)
        back = huggingface.read_table(table, lambda n, t: written[n].T if t else written[n])
        assert back.keys() == ours.keys(), head
        for path, value in ours.items():
            np.testing.assert_array_equal(back[path], value)


def test_a_partial_head_is_refused():
    state = {"classifier.weight": np.zeros((2, 4), np.float32)}
    state.update({f"bert.{k}": v for k, v in _backbone_state().items()})
    with pytest.raises(PresetError, match="lacks \\['classifier.bias'\\]"):
        huggingface.head_weights("BertClassifier", state)
    assert huggingface.head_weights("BertQuestionAnswerer", state) is None


def _backbone_state():
    backbone = kbert.BertBackbone(**TINY)
    return huggingface.backbone_state_to_hf(backbone)
