"""examples/distill.py end to end with a tiny random teacher."""

import json

import keras
import pytest

import kbert

from .helpers import load_example


# The script is backend-agnostic plumbing (text -> inputs -> fit -> preset);
# tests/models/test_distiller.py covers the distiller on every backend. One
# run, on the backend where it is quickest (JAX compiles fit and evaluate).
@pytest.mark.skipif(keras.backend.backend() != "torch", reason="runs once, under torch")
def test_distill_example_saves_a_student_preset(tmp_path, tiny_preset):
    teacher = kbert.BertBackbone.from_preset(tiny_preset)
    result = load_example("distill").main(
        [
            "--preset",
            tiny_preset,
            "--layers",
            "0",
            "--sequences",
            "18",
            "--sequence-length",
            "16",
            "--batch-size",
            "8",
            "--output-dir",
            str(tmp_path),
            "--verbose",
            "0",
        ]
    )
    assert result["train_sequences"] == 16 and result["steps"] == 2
    for losses in (result["held_out_before"], result["held_out_after"]):
        assert set(losses) >= {"loss", "cos_loss", "hidden_loss", "attention_loss"}
    # a student of the one teacher block starts as the teacher: no hidden-state gap
    assert result["held_out_before"]["cos_loss"] < 1e-5
    assert json.load(open(tmp_path / "results.json"))["steps"] == 2
    student = kbert.BertBackbone.from_preset(result["student"])
    assert student.num_layers == 1 and student.hidden_dim == teacher.hidden_dim
    classifier = kbert.BertClassifier.from_preset(result["student"], num_classes=2)
    assert classifier.preprocessor.tokenizer.vocabulary_size == teacher.vocabulary_size
