"""examples/seq2seq.py end to end with a tiny random model (conftest.tiny_preset)
on a few WikiSplit-format lines."""

import json

import pytest

from .helpers import load_example

LINES = [
    "the cat sat on the mat and the dog ran .\tthe cat sat on the mat . <::::> the dog ran .",
    "a man is here and a dog is there .\ta man is here . <::::> a dog is there .",
] * 4


@pytest.mark.parametrize("recipe", ["bert", "transformers"])
def test_seq2seq_example_runs_and_scores(tmp_path, tiny_preset, recipe):
    for name in ("tune.tsv", "validation.tsv"):
        (tmp_path / name).write_text("\n".join(LINES) + "\n")
    example = load_example("seq2seq")
    flags = "--system bert2rnd --epochs 1 --batch-size 4 --source-length 24 --target-length 8"
    flags += f" --max-eval-examples 4 --verbose 0 --recipe {recipe}"
    result = example.main(
        ["--preset", tiny_preset, "--data-dir", str(tmp_path), "--output-dir", str(tmp_path)]
        + flags.split()
    )
    assert (result["train_examples"], result["eval_examples"]) == (8, 4)
    assert result["recipe"] == recipe and len(result["epoch_losses"]) == 1
    assert 0.0 <= result["sari"] <= 100.0 and 0.0 <= result["exact_match"] <= 100.0
    assert json.load(open(tmp_path / "results.json"))["sari"] == result["sari"]
    assert all(isinstance(e["output"], str) for e in result["examples"])
