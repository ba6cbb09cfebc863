"""A config is checked against its weights' shapes before anything is built:
kbert presets, Hugging Face directories and keras-hub presets whose config
asks for sizes the weights do not hold fail at once, naming the setting; a
vocabulary with more tokens than embedding rows is refused."""

import hashlib
import json
import logging
import shutil

import numpy as np
import pytest

import kbert
from kbert.convert.huggingface import export_to_huggingface
from kbert.presets import PresetError
from tests.harness import TINY

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(92)]  # 97


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A kbert backbone preset and a Hugging Face export of the same TINY backbone."""
    root = tmp_path_factory.mktemp("saved")
    backbone = kbert.BertBackbone(**TINY)
    backbone.save_to_preset(root / "kbert")
    export_to_huggingface(backbone, root / "hf")
    return root


@pytest.fixture
def never_built(monkeypatch):
    """Building a backbone fails the test: the checks must come first."""

    def refuse(config):
        raise AssertionError(f"a backbone was built from {config}")

    monkeypatch.setattr(kbert.BertBackbone, "from_config", classmethod(lambda cls, c: refuse(c)))


def _copy(saved, kind, tmp_path):
    return shutil.copytree(saved / kind, tmp_path / kind)


def _edit_kbert_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config["config"].update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    metadata = json.loads((directory / "metadata.json").read_text())
    metadata["files"]["config.json"] = hashlib.sha256(
        (directory / "config.json").read_bytes()
    ).hexdigest()
    (directory / "metadata.json").write_text(json.dumps(metadata))


def _edit_hf_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


KBERT_CASES = [
    ({"num_layers": 100}, "num_layers=100 but the weights hold 2"),
    ({"num_layers": 1000}, "num_layers=1000 is beyond any BERT"),
    ({"hidden_dim": 10**6}, "hidden_dim=1000000 is beyond any BERT"),
    ({"vocabulary_size": 500_000}, "vocabulary_size=500000 but the weights hold 97"),
    ({"max_sequence_length": 100_000}, "max_sequence_length=100000 but the weights hold 24"),
    ({"type_vocab_size": 60_000}, "type_vocab_size=60000 but the weights hold 2"),
    ({"intermediate_dim": 60_000}, "intermediate_dim=60000 but the weights hold 37"),
    ({"num_heads": 5}, "hidden_dim=32 is not divisible by num_heads=5"),
    ({"num_layers": "2"}, "num_layers must be a positive integer"),
    ({"hidden_dim": 32.0}, "hidden_dim must be a positive integer"),
    ({"dropout": [0.1]}, "dropout must be a number"),
]


@pytest.mark.parametrize("changes, message", KBERT_CASES, ids=lambda c: str(c)[:30])
def test_kbert_preset_config_beyond_its_weights(saved, tmp_path, never_built, changes, message):
    directory = _copy(saved, "kbert", tmp_path)
    _edit_kbert_config(directory, **changes)
    with pytest.raises(PresetError, match=message) as error:
        kbert.BertBackbone.from_preset(directory)
    assert "config.json" in str(error.value)


HF_CASES = [
    ({"num_hidden_layers": 200}, "num_layers=200 but the weights hold 2"),
    ({"hidden_size": 10**6}, "hidden_dim=1000000 is beyond any BERT"),
    ({"vocab_size": 10**5}, "vocabulary_size=100000 but the weights hold 97"),
    ({"max_position_embeddings": 4096}, "max_sequence_length=4096 but the weights hold 24"),
    ({"num_attention_heads": 3}, "not divisible by num_heads=3"),
    ({"intermediate_size": None}, "intermediate_dim must be a positive integer"),
    ({"hidden_act": 3}, "hidden_act must be a name"),
]


@pytest.mark.parametrize("changes, message", HF_CASES, ids=lambda c: str(c)[:30])
def test_huggingface_config_beyond_its_weights(saved, tmp_path, never_built, changes, message):
    directory = _copy(saved, "hf", tmp_path)
    _edit_hf_config(directory, **changes)
    with pytest.raises(PresetError, match=message):
        kbert.BertBackbone.from_preset(directory)


def _keras_hub_dir(directory, num_layers, num_heads=2):
    """A keras-hub preset whose weights file holds only the tables the
    config is checked against (V=12, H=8, 8 positions, 1 block)."""
    h5py = pytest.importorskip("h5py")
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps(
            {
                "registered_name": "keras_hub>BertBackbone",
                "config": {
                    "vocabulary_size": 12,
                    "num_layers": num_layers,
                    "num_heads": num_heads,
                    "hidden_dim": 8,
                    "intermediate_dim": 16,
                    "max_sequence_length": 8,
                },
            }
        )
    )
    with h5py.File(directory / "model.weights.h5", "w") as f:
        for name, shape in [
            ("reversible_embedding", (12, 8)),
            ("position_embedding", (8, 8)),
            ("embedding", (2, 8)),
            ("transformer_encoder/_feedforward_intermediate_dense", (8, 16)),
            ("transformer_encoder/_self_attention_layer/query_dense", (8, 2, 4)),
        ]:
            f.create_dataset(f"layers/{name}/vars/0", data=np.zeros(shape, "float32"))
    return directory


def test_keras_hub_config_beyond_its_weights(tmp_path, never_built):
    directory = _keras_hub_dir(tmp_path / "kh", num_layers=48)
    with pytest.raises(PresetError, match="num_layers=48 but the weights hold 1"):
        kbert.BertBackbone.from_preset(directory)
    directory = _keras_hub_dir(tmp_path / "kh4", num_layers=1, num_heads=4)
    with pytest.raises(PresetError, match="num_heads=4 but the weights hold 2 heads"):
        kbert.BertBackbone.from_preset(directory)


def test_config_without_weights_builds_within_bounds(tmp_path):
    directory = tmp_path / "hf"
    directory.mkdir()
    config = {
        "model_type": "bert",
        "vocab_size": 50,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "max_position_embeddings": 16,
    }
    (directory / "config.json").write_text(json.dumps(config))
    backbone = kbert.BertBackbone.from_preset(directory, load_weights=False)
    assert (backbone.vocabulary_size, backbone.num_layers, backbone.hidden_dim) == (50, 2, 16)
    huge = {**config, "vocab_size": 2_000_000, "hidden_size": 8192, "num_attention_heads": 64}
    (directory / "config.json").write_text(json.dumps(huge))
    with pytest.raises(PresetError, match="parameters, more than"):
        kbert.BertBackbone.from_preset(directory, load_weights=False)
    with pytest.raises(PresetError, match="weights"):  # and with weights asked for, none exist
        kbert.BertBackbone.from_preset(directory)


@pytest.mark.parametrize("kind", ["kbert", "hf"])
def test_vocabulary_larger_than_the_embedding_table_is_refused(saved, tmp_path, kind, caplog):
    directory = _copy(saved, kind, tmp_path)

    def write_vocabulary(tokens):
        (directory / "vocab.txt").write_text("\n".join(tokens) + "\n")
        if kind == "kbert":  # a vocabulary listed in the metadata, checksum and all
            metadata = json.loads((directory / "metadata.json").read_text())
            metadata["files"]["vocab.txt"] = hashlib.sha256(
                (directory / "vocab.txt").read_bytes()
            ).hexdigest()
            (directory / "metadata.json").write_text(json.dumps(metadata))

    write_vocabulary(VOCAB + ["extra1", "extra2"])
    with pytest.raises(PresetError, match="holds 99 tokens but the embedding table has 97 rows"):
        kbert.BertClassifier.from_preset(directory, num_classes=2)
    write_vocabulary(VOCAB[:90])
    with caplog.at_level(logging.WARNING, logger="kbert"):
        model = kbert.BertBackbone.from_preset(directory)
    assert "holds 90 tokens, fewer than the embedding table's 97 rows" in caplog.text
    assert model.vocabulary_size == 97


def test_preprocessor_larger_than_the_embedding_table_is_refused(saved):
    big = kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB + ["extra"]), 8)
    with pytest.raises(PresetError, match="holds 98 tokens but the backbone"):
        kbert.BertClassifier.from_preset(saved / "kbert", num_classes=2, preprocessor=big)
