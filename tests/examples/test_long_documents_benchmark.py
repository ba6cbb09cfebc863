"""benchmarks/long_documents.py: its data (Hyperpartisan, the needle task)
and one tiny run of every system."""

import importlib.util
import os

import keras
import numpy as np
import pytest

import kbert

from .helpers import ROOT, SHARED, VOCAB


def _benchmark():
    path = os.path.join(ROOT, "benchmarks", "long_documents.py")
    spec = importlib.util.spec_from_file_location("long_documents_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_needle_sentence_sits_after_the_given_token():
    bench = _benchmark()
    tokenizer = kbert.BertTokenizer(VOCAB)
    texts, labels, positions = bench.needle_documents(tokenizer, 6, 0, 60, 40)
    for text, label, at in zip(texts, labels, positions):
        ids = tokenizer.tokenize(text)
        needle = tokenizer.tokenize(bench.NEEDLES[0][label])
        assert at >= 40 and ids[at : at + len(needle)] == needle
        other = tokenizer.tokenize(bench.NEEDLES[0][1 - label])
        assert all(ids[i : i + len(other)] != other for i in range(len(ids)))


@pytest.mark.skipif(
    not os.path.isdir(os.path.join(SHARED, "hyperpartisan")), reason="no shared data"
)
def test_hyperpartisan_loads_and_splits_stratified():
    bench = _benchmark()
    texts, labels = bench.load_hyperpartisan(SHARED)
    assert len(texts) == 645 and set(np.unique(labels)) == {0, 1}
    train, dev, test = bench.stratified_split(labels, 3)
    assert (len(train), len(dev), len(test)) == (516, 64, 65)
    assert len(set(train) | set(dev) | set(test)) == 645
    assert abs(labels[test].mean() - labels.mean()) < 0.02


# backend-agnostic plumbing over models the model tests cover on every backend
@pytest.mark.skipif(keras.backend.backend() != "torch", reason="runs once, under torch")
def test_every_system_runs_on_the_needle_task(tiny_preset, tmp_path):
    output = tmp_path / "needle.json"
    args = "--task needle --train 8 --eval 4 --needle-length 50 --needle-after 30"
    args += " --long-length 64 --short-length 16 --window 8 --seeds 0 --epochs 1"
    args += f" --batch-size 4 --memory-tokens 4 --preset {tiny_preset} --output {output}"
    result = _benchmark().main(args.split())
    runs = {r["system"]: r for r in result["runs"]}
    assert set(runs) == {"truncate", "chunks", "memory", "full", "window"}
    assert runs["truncate"]["backbone"]["sequence_length"] == 16
    assert runs["full"]["backbone"]["max_sequence_length"] == 64
    assert runs["window"]["backbone"]["attention_window"] == 8
    assert runs["memory"]["backbone"]["memory_tokens"] == 4
    for run in runs.values():
        assert 0.0 <= run["test_at_best_dev"]["accuracy"] <= 1.0
    assert set(result["summary"]) == set(runs) and output.exists()


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="runs once, under torch")
def test_speed_script_measures_kbert_and_longformer_at_tiny_size():
    path = os.path.join(ROOT, "benchmarks", "long_attention_speed.py")
    spec = importlib.util.spec_from_file_location("long_attention_speed", path)
    speed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(speed)
    args = "--tiny --in-process --engines kbert-torch longformer --steps 1 --warmup 0"
    results = speed.main(args.split() + ["--lengths", "64"])
    assert [r["engine"] for r in results] == ["kbert-torch", "longformer"]
    assert results[0]["attention_path"] == "banded"
    for r in results:
        assert r["forward_tokens_per_s"] > 0 and r["train_tokens_per_s"] > 0
