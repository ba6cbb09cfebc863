"""The `kbert` command: argument parsing and dispatch, standard library only.

`import kbert` imports Keras and a backend (it registers every model and layer
for `keras.saving`), which takes seconds. This package sits outside `kbert` so
that `kbert --help`, each command's `--help` and `kbert presets` run without it;
the commands that need models or data import `kbert.cli` and run there.

    kbert presets
    kbert convert ./hf_bert ./kbert_preset
    kbert export ./kbert_preset ./served --text
    python -m kbert_cli --help
"""

import argparse
import importlib.util
import json
import os
import sys

COMMANDS = {
    # command: function of kbert.cli that runs it
    "create-pretraining-data": "create_pretraining_data",
    "convert": "convert",
    "check-pretraining-data": "check_pretraining_data",
    "export": "export",
}


def _registry_file():
    # find_spec of a top-level package locates it without running its __init__.
    spec = importlib.util.find_spec("kbert")
    if spec is None or not spec.submodule_search_locations:
        raise OSError("the kbert package is not installed; pip install kbert")
    return os.path.join(list(spec.submodule_search_locations)[0], "presets", "presets.json")


def list_presets():
    """{name: description} of the registered presets (kbert.presets.list_presets,
    read from the same file without importing kbert)."""
    with open(_registry_file(), encoding="utf-8") as f:
        return {name: entry["description"] for name, entry in json.load(f).items()}


def _presets(args):
    for name, description in list_presets().items():
        print(f"{name}\t{description}")
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="kbert", description="BERT for Keras 3.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("presets", help="list registered presets")

    create = commands.add_parser(
        "create-pretraining-data",
        help="documents -> MLM/NSP TFRecords (original BERT feature format)",
    )
    create.add_argument(
        "--input", nargs="+", required=True, help="corpus files, one output shard each"
    )
    create.add_argument("--vocab", required=True, help="vocab.txt")
    create.add_argument("--output", required=True, help="output directory")
    create.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=True)
    create.add_argument("--format", default="lines", choices=["lines", "prose", "wikitext"])
    create.add_argument("--max-seq-length", type=int, default=128)
    create.add_argument("--max-predictions-per-seq", type=int, default=20)
    create.add_argument("--masked-lm-prob", type=float, default=0.15)
    create.add_argument("--dupe-factor", type=int, default=10)
    create.add_argument("--short-seq-prob", type=float, default=0.1)
    create.add_argument("--seed", type=int, default=12345)
    create.add_argument("--whole-word-mask", action="store_true")
    create.add_argument(
        "--sentence-task",
        default="nsp",
        choices=["nsp", "sop"],
        help="next sentence prediction (BERT) or sentence-order prediction (ALBERT)",
    )
    create.add_argument("--workers", type=int, default=None)

    convert = commands.add_parser("convert", help="kbert preset <-> Hugging Face directory")
    convert.add_argument("source", help="kbert preset or Hugging Face BERT directory")
    convert.add_argument("destination")
    convert.add_argument("--to", choices=["kbert", "huggingface"], default="kbert")

    export = commands.add_parser(
        "export", help="serving artifacts: SavedModel (optionally raw strings in) or ONNX"
    )
    export.add_argument("source", help="kbert preset, Hugging Face BERT directory or .keras file")
    export.add_argument(
        "destination",
        help="SavedModel directory, or for ONNX a directory for model.onnx and tokenizer.json",
    )
    export.add_argument("--format", choices=["saved_model", "onnx"], default="saved_model")
    export.add_argument(
        "--text",
        action="store_true",
        help="SavedModel signatures take raw strings (tokenizer in the graph; tasks only)",
    )

    check = commands.add_parser("check-pretraining-data", help="statistics of a created directory")
    check.add_argument("directory")

    # kbert.programs.pretrain parses its own flags (those of examples/pretrain.py).
    commands.add_parser(
        "pretrain", help="pre-train MLM + NSP from raw text (kbert pretrain --help)", add_help=False
    )
    return parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "pretrain":
        from kbert import cli

        return cli.pretrain(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "presets":
        run = _presets
    else:
        from kbert import cli

        run = getattr(cli, COMMANDS[args.command])
    try:
        return run(args)
    except (ValueError, OSError) as e:
        print(f"kbert {args.command}: error: {e}", file=sys.stderr)
        return 2
