"""What the `kbert` commands run: create-pretraining-data, check-pretraining-data,
convert, pretrain.

The command line itself (arguments, `--help`, `kbert presets`) is `kbert_cli`,
which needs only the standard library and imports this module when a command
runs; `python -m kbert.cli` is the same command.
"""

import json
import os
import runpy
import sys

import kbert_cli
from kbert import models
from kbert.convert import huggingface, tf_checkpoint
from kbert.data import MaskingConfig, check_directory
from kbert.data import create_pretraining_data as create_data
from kbert.tokenizers import BertTokenizer


def create_pretraining_data(args):
    tokenizer = BertTokenizer(args.vocab, lowercase=args.lowercase)
    masking = MaskingConfig(
        max_seq_length=args.max_seq_length,
        max_predictions_per_seq=args.max_predictions_per_seq,
        masked_lm_prob=args.masked_lm_prob,
        short_seq_prob=args.short_seq_prob,
        whole_word_mask=args.whole_word_mask,
    )
    create_data(
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


def check_pretraining_data(args):
    print(json.dumps(check_directory(args.directory), indent=2))
    return 0


def _load_any(source):
    """The model a preset, Hugging Face or original TF checkpoint directory holds,
    with its head."""
    task_path = os.path.join(source, "task.json")
    if os.path.isfile(task_path):
        with open(task_path) as f:
            name = json.load(f).get("class_name")
        cls = getattr(models, str(name), None)
        if not (isinstance(cls, type) and issubclass(cls, models.Task)):
            raise ValueError(f"{task_path} names an unknown task {name!r}")
        return cls.from_preset(source)
    if tf_checkpoint.is_tf_checkpoint_dir(source):
        # the original releases are pre-training checkpoints: MLM + NSP heads
        return models.BertPreTrainer.from_preset(source)
    if huggingface.is_huggingface_dir(source):
        with open(os.path.join(source, "config.json")) as f:
            config = json.load(f)
        architecture = (config.get("architectures") or ["BertModel"])[0]
        if architecture == "BertForPreTraining":
            return models.BertPreTrainer.from_preset(source)
        if architecture == "BertForMaskedLM":
            return models.BertMaskedLM.from_preset(source)
        if architecture == "BertForSequenceClassification":
            return models.BertClassifier.from_preset(
                source, num_classes=len(config.get("id2label", {})) or config.get("num_labels", 2)
            )
        if architecture == "BertForTokenClassification":
            return models.BertTokenClassifier.from_preset(
                source, num_classes=len(config.get("id2label", {})) or config.get("num_labels", 2)
            )
        if architecture == "BertForQuestionAnswering":
            return models.BertQuestionAnswerer.from_preset(source)
    return models.BertBackbone.from_preset(source)


def convert(args):
    model = _load_any(args.source)
    if args.to == "huggingface":
        huggingface.export_to_huggingface(model, args.destination)
    else:
        model.save_to_preset(args.destination)
    print(f"wrote {type(model).__name__} to {args.destination} ({args.to})")
    return 0


def pretrain(argv):
    """Runs examples/pretrain.py with `argv` as its arguments."""
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "pretrain.py")
    if not os.path.isfile(script):
        print(
            "kbert pretrain needs examples/pretrain.py (run from a source checkout)",
            file=sys.stderr,
        )
        return 2
    sys.argv = [script] + list(argv)
    runpy.run_path(script, run_name="__main__")
    return 0


def main(argv=None):
    """The `kbert` command (kbert_cli.main)."""
    return kbert_cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
