"""kbert.programs.pretrain's flags; the run itself is tested through
examples/pretrain.py (tests/examples/test_pretrain_example.py)."""

import importlib.util
import os

import pytest

from kbert.programs import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_shipped_corpus_is_found_in_examples_data():
    corpus = pretrain.shipped_corpus(os.path.join(ROOT, "examples", "data"))
    assert [os.path.basename(path) for path in corpus] == list(pretrain.SHIPPED_CORPUS)
    assert pretrain.parse_args([], default_corpus=corpus).corpus == corpus


def test_corpus_is_required_without_a_default(tmp_path, capsys):
    assert pretrain.shipped_corpus(str(tmp_path)) is None
    with pytest.raises(SystemExit):
        pretrain.parse_args([], prog="kbert pretrain")
    assert "the following arguments are required: --corpus" in capsys.readouterr().err
    args = pretrain.parse_args(["--corpus", "a.txt", "b.txt", "--steps", "7"])
    assert args.corpus == ["a.txt", "b.txt"] and args.steps == 7


def test_example_runs_the_program():
    """examples/pretrain.py is the program with the shipped corpus as default."""
    path = os.path.join(ROOT, "examples", "pretrain.py")
    spec = importlib.util.spec_from_file_location("pretrain_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.pretrain is pretrain
    assert example.CORPUS == pretrain.shipped_corpus(os.path.join(ROOT, "examples", "data"))
