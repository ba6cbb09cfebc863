"""The `kbert` command: help and the preset list without Keras, commands through kbert.cli."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import kbert
import kbert_cli
from kbert.presets import registry
from tests.harness import TINY, to_numpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ["presets", "create-pretraining-data", "convert", "check-pretraining-data", "pretrain"]
HEAVY = ["kbert", "keras", "tensorflow", "torch", "jax", "transformers"]


def _python(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_help_lists_the_commands():
    result = _python("-m", "kbert_cli", "--help")
    assert result.returncode == 0, result.stderr
    for command in COMMANDS:
        assert command in result.stdout


LIGHT = """
import json, sys
from kbert_cli import main
codes = []
for argv in json.loads(sys.argv[1]):
    try:
        codes.append(main(argv))
    except SystemExit as e:
        codes.append(e.code)
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[2])))
print(json.dumps({"codes": codes, "heavy": heavy}))
"""


def test_help_and_presets_import_no_keras_or_backend():
    """--help, each command's --help and `presets` stay in the standard library."""
    argvs = [["--help"], ["presets"]] + [[c, "--help"] for c in COMMANDS if c != "pretrain"]
    result = _python("-c", LIGHT, json.dumps(argvs), json.dumps(HEAVY))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["codes"] == [0] * len(argvs)
    assert report["heavy"] == []


def test_pretrain_names_itself_kbert_pretrain():
    """`kbert pretrain` runs kbert.programs.pretrain, whose usage and errors
    name the command the user typed."""
    result = _python("-m", "kbert_cli", "pretrain", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: kbert pretrain ")
    assert "--corpus" in result.stdout
    result = _python("-m", "kbert_cli", "pretrain", "--no-such-option")
    assert result.returncode == 2
    assert "kbert pretrain: error: unrecognized arguments: --no-such-option" in result.stderr


def test_presets_lists_the_registered_names():
    result = _python("-m", "kbert_cli", "presets")
    assert result.returncode == 0, result.stderr
    listed = dict(line.split("\t") for line in result.stdout.strip().splitlines())
    assert listed == registry.list_presets() == kbert.presets.list_presets()
    assert kbert_cli.list_presets() == registry.list_presets()


def test_kbert_cli_module_is_the_same_command(capsys):
    from kbert.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(command in out for command in COMMANDS)


def test_convert_both_ways_through_the_command(tmp_path, capsys):
    model = kbert.BertBackbone(**TINY)
    model.save_to_preset(tmp_path / "kb")
    assert (
        kbert_cli.main(
            ["convert", str(tmp_path / "kb"), str(tmp_path / "hf"), "--to", "huggingface"]
        )
        == 0
    )
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "bert"
    assert kbert_cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    assert "wrote BertBackbone" in capsys.readouterr().out
    again = kbert.BertBackbone.from_preset(tmp_path / "back")
    for a, b in zip(model.weights, again.weights):
        assert a.path == b.path
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


def test_command_errors_name_the_command(tmp_path, capsys):
    assert kbert_cli.main(["convert", str(tmp_path / "missing"), str(tmp_path / "x")]) == 2
    assert "kbert convert: error:" in capsys.readouterr().err


def test_create_pretraining_data_with_sentence_order(tmp_path, capsys):
    pytest.importorskip("tensorflow")
    if keras.backend.backend() != "jax":
        pytest.skip("data creation is backend-independent: checked in the jax pass")
    corpus = tmp_path / "corpus.txt"
    with open(os.path.join(ROOT, "examples", "data", "wikitext-2-valid.tokens.txt")) as f:
        corpus.write_text("".join(f.readlines()[:120]))
    vocab = tmp_path / "vocab.txt"
    words = sorted(set(corpus.read_text().lower().split()))
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    out = tmp_path / "data"
    command = ["create-pretraining-data", "--input", str(corpus), "--vocab", str(vocab)]
    command += ["--output", str(out), "--format", "wikitext", "--max-seq-length", "32"]
    assert kbert_cli.main([*command, "--dupe-factor", "2", "--sentence-task", "sop"]) == 0
    capsys.readouterr()
    assert kbert_cli.main(["check-pretraining-data", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(printed[printed.index("{") :])
    assert "sop_swapped_share" in json.dumps(report) and "nsp_random_share" not in json.dumps(
        report
    )


def test_check_pretraining_data_names_a_missing_directory(tmp_path, capsys):
    code = kbert_cli.main(["check-pretraining-data", str(tmp_path / "missing")])
    assert code != 0
    assert "is not a directory; pass the output directory of" in capsys.readouterr().err
