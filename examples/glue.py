"""Fine-tune a BERT on a GLUE task (SST-2, CoLA, MRPC, STS-B) and report its dev metric.

    KERAS_BACKEND=jax python examples/glue.py            # the STS-B sample in examples/data
    KERAS_BACKEND=jax python examples/glue.py --task sst2 --dataset nyu-mll/glue
    python examples/glue.py --task mrpc --data-dir glue_data --preset path/to/bert

Data: with `--dataset`, the task through Hugging Face `datasets` (the Hub's
"nyu-mll/glue", configuration = the task; train and validation splits);
otherwise the GLUE files in `--data-dir` (`<TASK>/{train,dev}.tsv`, as in
the GLUE download), by default a 300/100-pair STS-B sample that ships with
kbert (trained with more, smaller steps: a few minutes on a CPU). The model
is `--preset` (a kbert preset, Hugging Face BERT directory or registered
name; default: the installed all-MiniLM-L6-v2). Texts are packed to
`--sequence-length` tokens (longest-first truncation). Metrics: SST-2
accuracy, CoLA Matthews correlation, MRPC F1 (and accuracy), STS-B Pearson
(and Spearman). The model is saved as `.keras` and a preset.
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import finetune_common as common  # noqa: E402
import keras  # noqa: E402

import kbert  # noqa: E402
from kbert import metrics  # noqa: E402
from kbert.data.finetuning import GLUE_DIRS, GLUE_TASKS  # noqa: E402
from kbert.data.sources import load_glue  # noqa: E402

# The sample's 300 pairs need more, smaller steps than a full task.
FULL = dict(epochs=3, batch_size=32, learning_rate=5e-5, sequence_length=128)
SAMPLE = dict(epochs=4, batch_size=8, learning_rate=1e-4, sequence_length=64)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--task", default="stsb", choices=sorted(GLUE_TASKS))
    common.add_data_args(
        p, "nyu-mll/glue", "GLUE files: <DIR>/<TASK>/{train,dev}.tsv, e.g. glue_data", "glue"
    )
    common.add_training_args(p, FULL, SAMPLE)
    args = p.parse_args(argv)
    return common.settle(args, FULL, SAMPLE, args.data_dir)


def glue_metrics(task, labels, predictions):
    if task == "stsb":
        return {
            "pearson": metrics.pearson(labels, predictions),
            "spearman": metrics.spearman(labels, predictions),
        }
    result = {"accuracy": metrics.accuracy(labels, predictions)}
    if task == "cola":
        result["mcc"] = metrics.matthews_corrcoef(labels, predictions)
    if task == "mrpc":
        result["f1"] = metrics.f1_score(labels, predictions)
    return result


def main(argv=None):
    args = parse_args(argv)
    keras.utils.set_random_seed(args.seed)  # head initialisation and dropout
    spec = GLUE_TASKS[args.task]
    if not args.dataset and not os.path.isdir(os.path.join(args.data_dir, GLUE_DIRS[args.task])):
        raise SystemExit(
            f"{args.data_dir} has no {GLUE_DIRS[args.task]} directory (the shipped sample is STS-B "
            "only); pass --dataset nyu-mll/glue or --data-dir with the GLUE files"
        )
    texts, pairs, labels = common.first(
        load_glue(args.task, "train", **common.source(args)), args.max_train_examples
    )
    dev_texts, dev_pairs, dev_labels = common.first(
        load_glue(args.task, "validation", **common.source(args)), args.max_eval_examples
    )
    model = kbert.BertClassifier.from_preset(
        args.preset, num_classes=spec["num_classes"], **common.task_kwargs(args)
    )
    model.preprocessor.sequence_length = args.sequence_length
    order = common.epoch_order(len(texts), args.epochs, args.seed)
    steps = -(-len(order) // args.batch_size)
    model.compile(learning_rate=args.learning_rate, num_train_steps=steps)
    x = common.take(texts, order)
    if pairs is not None:
        x = (x, common.take(pairs, order))
    y = np.asarray(labels, "float32" if spec["kind"] == "score" else "int32")[order]
    start = time.time()
    model.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=args.verbose)
    train_seconds = time.time() - start
    dev_x = dev_texts if dev_pairs is None else (dev_texts, dev_pairs)
    predictions = model.predict_classes(dev_x, batch_size=128)
    result = {
        "task": args.task,
        "data": args.dataset or args.data_dir,
        "train_examples": len(texts),
        "dev_examples": len(dev_texts),
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "train_seconds": round(train_seconds, 1),
        **glue_metrics(args.task, dev_labels, predictions),
    }
    return common.finish(
        model, result, args.output_dir or os.path.join("runs", f"glue-{args.task}")
    )


if __name__ == "__main__":
    main()
