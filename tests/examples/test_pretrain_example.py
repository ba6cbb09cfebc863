"""examples/pretrain.py end to end on a tiny configuration."""

import json
import os

import keras
import numpy as np
import pytest

from kbert.training.callbacks import read_curves

from .helpers import ROOT, load_example

pytest.importorskip("tensorflow")


def tiny_run_args(tmp_path, steps, steps_per_checkpoint=2):
    """A 400-line corpus and a one-layer model at sequence length 32, writing
    to tmp_path/run."""
    with open(
        os.path.join(ROOT, "examples", "data", "wikitext-2-valid.tokens.txt"), encoding="utf-8"
    ) as f:
        lines = f.readlines()[:400]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(lines), encoding="utf-8")
    return [
        "--corpus",
        str(corpus),
        "--output-dir",
        str(tmp_path / "run"),
        "--vocab-size",
        "400",
        "--num-layers",
        "1",
        "--hidden-dim",
        "16",
        "--num-heads",
        "2",
        "--intermediate-dim",
        "32",
        "--max-seq-length",
        "32",
        "--max-predictions-per-seq",
        "5",
        "--batch-size",
        "4",
        "--steps",
        str(steps),
        "--steps-per-checkpoint",
        str(steps_per_checkpoint),
        "--eval-batches",
        "2",
        "--dupe-factor",
        "1",
        "--eval-fraction",
        "0.3",
        "--verbose",
        "0",
    ]


def split(points, name):
    return [p for p in points if p["split"] == name]


@pytest.mark.large
def test_pretrain_runs_resumes_and_saves(tmp_path):
    example = load_example("pretrain")
    args = tiny_run_args(tmp_path, steps=20, steps_per_checkpoint=10)
    results = example.main(args)
    assert 0.0 <= results["mlm_accuracy"] <= 1.0 and 0.0 <= results["nsp_accuracy"] <= 1.0
    run = tmp_path / "run"
    assert (run / "pretrainer.keras").is_file() and (run / "preset" / "metadata.json").is_file()
    assert (run / "logs" / "phase1.csv").is_file()
    assert sorted(os.listdir(run / "checkpoints" / "phase1")) == [
        "ckpt-000000010",
        "ckpt-000000020",
    ]
    # curves.png is drawn from curves.jsonl: training figures every 10 steps
    # (the default --log-every), held-out figures at each checkpoint.
    points = read_curves(str(run / "curves.jsonl"))
    assert [p["step"] for p in split(points, "train")] == [10, 20]
    assert [p["step"] for p in split(points, "held_out")] == [10, 20]
    keys = {"loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy"}
    assert all(keys <= set(p) for p in points)
    assert split(points, "held_out")[-1]["mlm_accuracy"] == pytest.approx(results["mlm_accuracy"])
    assert (run / "curves.png").stat().st_size > 10_000
    # The same command again resumes: nothing left to train, same results and curves.
    again = example.main(args)
    assert again["mlm_accuracy"] == pytest.approx(results["mlm_accuracy"])
    assert read_curves(str(run / "curves.jsonl")) == points
    # The artifact reloads and predicts; the preset gives the backbone.
    import kbert

    model = keras.saving.load_model(str(run / "pretrainer.keras"))
    x = {
        "token_ids": np.array([[2, 10, 11, 3, 12, 3, 0, 0]], "int32"),
        "segment_ids": np.array([[0, 0, 0, 0, 1, 1, 0, 0]], "int32"),
        "padding_mask": np.array([[1, 1, 1, 1, 1, 1, 0, 0]], "int32"),
        "mask_positions": np.array([[1, 4]], "int32"),
    }
    out = model.predict(x, verbose=0)
    assert out["mlm_logits"].shape == (1, 2, 400) and np.all(np.isfinite(out["nsp_logits"]))
    backbone = kbert.BertBackbone.from_preset(str(run / "preset"))
    assert backbone.vocabulary_size == 400
    assert json.loads((run / "results.json").read_text())["backend"] == keras.backend.backend()


@pytest.mark.large
def test_pretrain_two_phases_resumes_in_phase_two(tmp_path):
    """Sequence length 32 then 64 with the same model and one optimizer
    schedule; a run stopped during phase 2 continues there."""
    example = load_example("pretrain")
    args = tiny_run_args(tmp_path, steps=2) + ["--max-position", "32", "--phase2-seq-length", "64"]
    args += ["--log-every", "1"]
    example.main(args + ["--phase2-steps", "2"])  # phase 1, then 2 of phase 2's steps
    run = tmp_path / "run"
    assert sorted(os.listdir(run / "checkpoints" / "phase2")) == ["ckpt-000000002"]
    results = example.main(args + ["--phase2-steps", "4"])  # the longer command continues phase 2
    assert sorted(os.listdir(run / "checkpoints" / "phase2")) == [
        "ckpt-000000002",
        "ckpt-000000004",
    ]
    assert 0.0 <= results["mlm_accuracy"] <= 1.0
    model = keras.saving.load_model(str(run / "pretrainer.keras"))
    assert model.backbone.max_sequence_length >= 64
    assert (
        int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 6
    )  # one schedule over both phases
    # One curve over both phases and both commands, in optimizer steps.
    points = read_curves(str(run / "curves.jsonl"))
    assert [p["step"] for p in split(points, "train")] == [1, 2, 3, 4, 5, 6]
    assert [p["step"] for p in split(points, "held_out")] == [2, 4, 6]
