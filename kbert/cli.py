"""The `kbert` command: presets, create-pretraining-data, check-pretraining-data, pretrain."""

import argparse
import json
import sys


def _presets(args):
    from kbert.presets import list_presets

    for name, description in list_presets().items():
        print(f"{name}\t{description}")
    return 0


def _create(args):
    from kbert.data import MaskingConfig, create_pretraining_data
    from kbert.tokenizers import BertTokenizer

    tokenizer = BertTokenizer(args.vocab, lowercase=args.lowercase)
    masking = MaskingConfig(
        max_seq_length=args.max_seq_length,
        max_predictions_per_seq=args.max_predictions_per_seq,
        masked_lm_prob=args.masked_lm_prob,
        short_seq_prob=args.short_seq_prob,
        whole_word_mask=args.whole_word_mask,
    )
    create_pretraining_data(
        args.input,
        tokenizer,
        args.output,
        masking=masking,
        dupe_factor=args.dupe_factor,
        seed=args.seed,
        format=args.format,
        workers=args.workers,
    )
    return 0


def _check(args):
    from kbert.data import check_directory

    print(json.dumps(check_directory(args.directory), indent=2))
    return 0


def _load_any(source, allow_pickle=False):
    """The model a preset or Hugging Face directory holds, with its head."""
    import json
    import os

    import kbert
    from kbert.convert import huggingface

    task_path = os.path.join(source, "task.json")
    if os.path.isfile(task_path):
        with open(task_path) as f:
            name = json.load(f).get("class_name")
        cls = getattr(kbert, str(name), None)
        if not (isinstance(cls, type) and issubclass(cls, kbert.models.Task)):
            raise ValueError(f"{task_path} names an unknown task {name!r}")
        return cls.from_preset(source)
    if huggingface.is_huggingface_dir(source):
        with open(os.path.join(source, "config.json")) as f:
            config = json.load(f)
        architecture = (config.get("architectures") or ["BertModel"])[0]
        if architecture == "BertForPreTraining":
            return kbert.BertPreTrainer.from_preset(source)
        if architecture == "BertForMaskedLM":
            return kbert.BertMaskedLM.from_preset(source)
        if architecture == "BertForSequenceClassification":
            return kbert.BertClassifier.from_preset(
                source, num_classes=len(config.get("id2label", {})) or config.get("num_labels", 2)
            )
        if architecture == "BertForTokenClassification":
            return kbert.BertTokenClassifier.from_preset(
                source, num_classes=len(config.get("id2label", {})) or config.get("num_labels", 2)
            )
        if architecture == "BertForQuestionAnswering":
            return kbert.BertQuestionAnswerer.from_preset(source)
    return kbert.BertBackbone.from_preset(source)


def _convert(args):
    from kbert.convert.huggingface import export_to_huggingface

    model = _load_any(args.source)
    if args.to == "huggingface":
        export_to_huggingface(model, args.destination)
    else:
        model.save_to_preset(args.destination)
    print(f"wrote {type(model).__name__} to {args.destination} ({args.to})")
    return 0


def _pretrain(args, rest):
    import os
    import runpy

    script = os.path.join(os.path.dirname(__file__), "..", "examples", "pretrain.py")
    if not os.path.isfile(script):
        print(
            "kbert pretrain needs examples/pretrain.py (run from a source checkout)",
            file=sys.stderr,
        )
        return 2
    sys.argv = [script] + rest
    runpy.run_path(script, run_name="__main__")
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="kbert", description="BERT for Keras 3.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("presets", help="list registered presets").set_defaults(func=_presets)

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
    create.add_argument("--workers", type=int, default=None)
    create.set_defaults(func=_create)

    convert = commands.add_parser("convert", help="kbert preset <-> Hugging Face directory")
    convert.add_argument("source", help="kbert preset or Hugging Face BERT directory")
    convert.add_argument("destination")
    convert.add_argument("--to", choices=["kbert", "huggingface"], default="kbert")
    convert.set_defaults(func=_convert)

    check = commands.add_parser("check-pretraining-data", help="statistics of a created directory")
    check.add_argument("directory")
    check.set_defaults(func=_check)

    commands.add_parser("pretrain", help="run examples/pretrain.py (same flags)", add_help=False)
    return parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "pretrain":
        return _pretrain(None, argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"kbert {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
