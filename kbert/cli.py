"""What the `kbert` commands run: create-pretraining-data, check-pretraining-data,
convert, export, pretrain.

The command line itself (arguments, `--help`, `kbert presets`) is `kbert_cli`,
which needs only the standard library and imports this module when a command
runs; `python -m kbert.cli` is the same command.
"""

import json
import os
import sys

import keras

import kbert_cli
from kbert import export as serving
from kbert import models
from kbert.convert import huggingface
from kbert.data import MaskingConfig, check_directory
from kbert.data import create_pretraining_data as create_data
from kbert.programs import pretrain as pretraining
from kbert.tokenizers import BertTokenizer


def create_pretraining_data(args):
    tokenizer = BertTokenizer(args.vocab, lowercase=args.lowercase)
    masking = MaskingConfig(
        max_seq_length=args.max_seq_length,
        max_predictions_per_seq=args.max_predictions_per_seq,
        masked_lm_prob=args.masked_lm_prob,
        short_seq_prob=args.short_seq_prob,
        whole_word_mask=args.whole_word_mask,
        sentence_task=args.sentence_task,
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
    if not os.path.isdir(args.directory):
        raise ValueError(
            f"{args.directory} is not a directory; pass the output directory of "
            "`kbert create-pretraining-data`"
        )
    print(json.dumps(check_directory(args.directory), indent=2))
    return 0


def _load_any(source):
    """The model a preset, Hugging Face or original TF checkpoint directory holds,
    with its head."""
    name, kwargs = models.preset_io.held_model(source)
    cls = getattr(models, name, None)
    if not (isinstance(cls, type) and issubclass(cls, (models.Task, models.BertBackbone))):
        raise ValueError(f"{source} holds an unknown model class {name!r}")
    return cls.from_preset(source, **kwargs)


def convert(args):
    model = _load_any(args.source)
    backbone = model if isinstance(model, models.BertBackbone) else model.backbone
    # A task carries its preprocessor; a backbone takes the source's tokenizer files along.
    preprocessor = getattr(model, "preprocessor", None) or models.preset_io.directory_preprocessor(
        args.source, backbone
    )
    if args.to == "huggingface":
        huggingface.export_to_huggingface(model, args.destination, preprocessor=preprocessor)
    else:
        model.save_to_preset(args.destination, preprocessor=preprocessor)
    carried = "with its tokenizer" if preprocessor is not None else "without a tokenizer"
    print(f"wrote {type(model).__name__} to {args.destination} ({args.to}, {carried})")
    return 0


def export(args):
    """SavedModel (model inputs, or raw strings with --text) or ONNX + tokenizer.json."""
    if args.source.endswith(".keras"):
        model = keras.saving.load_model(args.source)
        preprocessor = getattr(model, "preprocessor", None)
    else:
        model = _load_any(args.source)
        backbone = model if isinstance(model, models.BertBackbone) else model.backbone
        preprocessor = getattr(
            model, "preprocessor", None
        ) or models.preset_io.directory_preprocessor(args.source, backbone)
    if args.text:
        if args.format != "saved_model":
            raise ValueError(
                "--text writes a SavedModel (the tokenizer runs in its graph); for ONNX "
                "drop --text: the tokenizer.json written beside model.onnx tokenizes"
            )
        serving.export_text_model(model, args.destination)
        print(f"wrote {type(model).__name__} taking raw strings to {args.destination}")
        return 0
    if args.format == "saved_model":
        serving.export_model(model, args.destination, format="tf_saved_model", verbose=False)
        print(f"wrote {type(model).__name__} SavedModel to {args.destination}")
        return 0
    os.makedirs(args.destination, exist_ok=True)
    path = os.path.join(args.destination, "model.onnx")
    serving.export_model(model, path, format="onnx", verbose=False)
    written = [path]
    if preprocessor is not None:
        written.append(serving.export_tokenizer_json(preprocessor, args.destination))
    print(f"wrote {type(model).__name__}: {', '.join(written)}")
    return 0


def pretrain(argv):
    """Runs kbert.programs.pretrain with `argv` as its arguments. Without
    --corpus it reads the shipped corpus of a source checkout (examples/data)."""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    corpus = pretraining.shipped_corpus(os.path.join(checkout, "examples", "data"))
    pretraining.main(list(argv), prog="kbert pretrain", default_corpus=corpus)
    return 0


def main(argv=None):
    """The `kbert` command (kbert_cli.main)."""
    return kbert_cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
