"""examples/glue.py, ner.py and squad.py end to end on their shipped samples
with a tiny random model (conftest.tiny_preset), on the real data in
../shared/data where present, and through `datasets` offline."""

import json
import os

import keras
import pytest

from .helpers import SHARED, load_example

# Whole batches only, so that a compiled backend compiles one training step.
SMALL = ["--epochs", "1", "--batch-size", "8", "--verbose", "0"]
FEW = ["--max-train-examples", "16", "--max-eval-examples", "8"]


def run(name, tmp_path, preset, *flags):
    return load_example(name).main(
        ["--preset", preset, "--output-dir", str(tmp_path)] + SMALL + list(flags)
    )


def test_glue_example_on_its_sample(tmp_path, tiny_preset):
    result = run("glue", tmp_path, tiny_preset, "--sequence-length", "32", *FEW)
    assert result["task"] == "stsb" and result["data"].endswith(os.path.join("data", "glue"))
    assert (result["train_examples"], result["dev_examples"]) == (16, 8)
    assert result["learning_rate"] == 1e-4  # the sample's default, not a full task's
    assert -1.0 <= result["pearson"] <= 1.0
    assert json.load(open(tmp_path / "results.json"))["pearson"] == result["pearson"]
    restored = keras.saving.load_model(result["model"])
    assert restored.predict_classes((["a man is here"], ["a man is there"])).shape == (1,)


def test_glue_example_names_the_fix_for_a_task_without_a_sample(tmp_path, tiny_preset):
    with pytest.raises(SystemExit, match="--dataset nyu-mll/glue"):
        run("glue", tmp_path, tiny_preset, "--task", "sst2")


def test_ner_example_on_its_sample(tmp_path, tiny_preset):
    result = run("ner", tmp_path, tiny_preset, "--sequence-length", "48", *FEW)
    assert result["labels"] == ["O", "B-MISC", "I-LOC", "I-MISC", "I-ORG", "I-PER"]  # IOB1
    assert (result["train_sentences"], result["eval_sentences"]) == (16, 8)
    assert 0.0 <= result["entity_f1"] <= 1.0 and 0.0 <= result["token_accuracy"] <= 1.0
    restored = keras.saving.load_model(result["model"])
    assert len(restored.predict_words([["Peter", "lives", "in", "Berlin"]])[0]) == 4


def test_squad_example_on_its_sample(tmp_path, tiny_preset):
    result = run(
        "squad",
        tmp_path,
        tiny_preset,
        *["--sequence-length", "128", "--doc-stride", "96", "--max-query-length", "24"],
        *["--max-train-examples", "4", "--max-eval-examples", "4", "--batch-size", "64"],
    )
    assert result["train_features"] > 4  # long paragraphs became several windows
    assert 0.0 <= result["exact_match"] <= result["f1"] <= 100.0
    assert len(json.load(open(tmp_path / "predictions.json"))) == 4


def test_ner_example_through_datasets_offline(tmp_path, tiny_preset, monkeypatch):
    """--dataset eriktks/conll2003 with the data set in the `datasets` cache:
    Hub tags (IOB2 class ids) become tag names."""
    datasets = pytest.importorskip("datasets")

    from .test_data_sources import cache_as_hub_id, hub_conll_dir

    cache = str(tmp_path / "cache")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    cache_as_hub_id(hub_conll_dir(str(tmp_path / "conll2003"))[0], "eriktks/conll2003", cache)
    result = run(
        "ner",
        tmp_path / "run",
        tiny_preset,
        *["--dataset", "eriktks/conll2003", "--eval-split", "validation"],
        *["--sequence-length", "48", *FEW],
    )
    assert result["data"] == "eriktks/conll2003" and result["eval_sentences"] == 8
    assert "B-PER" in result["labels"]


needs_shared = pytest.mark.skipif(not os.path.isdir(SHARED), reason="../shared/data is not present")


@needs_shared
@pytest.mark.parametrize("task", ["sst2", "mrpc"])
def test_glue_example_on_the_glue_files(task, tmp_path, tiny_preset):
    result = run(
        "glue",
        tmp_path,
        tiny_preset,
        *["--task", task, "--data-dir", os.path.join(SHARED, "glue"), "--sequence-length", "32"],
        *FEW,
    )
    assert 0.0 <= result["accuracy"] <= 1.0 and result["dev_examples"] == 8
    assert result["learning_rate"] == 5e-5


@needs_shared
def test_ner_example_on_conll_2003(tmp_path, tiny_preset):
    result = run(
        "ner",
        tmp_path,
        tiny_preset,
        *["--data-dir", os.path.join(SHARED, "conll2003"), "--sequence-length", "48"],
        *FEW,
    )
    assert len(result["labels"]) == 8  # IOB1: eng.train has no B-PER
    assert 0.0 <= result["entity_f1"] <= 1.0
