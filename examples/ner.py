"""Fine-tune a BERT tagger for named entities (CoNLL-2003) and report entity-level F1.

    KERAS_BACKEND=jax python examples/ner.py             # the sample in examples/data
    KERAS_BACKEND=jax python examples/ner.py --dataset eriktks/conll2003
    python examples/ner.py --data-dir conll2003 --eval-split validation --preset path/to/bert

Data: with `--dataset`, CoNLL-2003 through Hugging Face `datasets` (columns
`tokens` and `ner_tags`); otherwise `eng.train`, `eng.testa` (validation)
and `eng.testb` (test) in `--data-dir` (columns `word POS chunk NER`, as
distributed), by default a 93-sentence sample in the same format that ships
with kbert (trained with more, smaller steps: a few minutes on a CPU). Each
word's label goes on its first WordPiece (the paper's set-up); sentences
longer than `--sequence-length` pieces are cut, and their cut words count as
"O" predictions in the score. Metric: micro entity F1 with the
conlleval/seqeval rules on `--eval-split` (default: test).
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
from kbert.data.sources import load_conll2003  # noqa: E402

# The sample's 67 sentences need more, smaller steps than CoNLL-2003's 14,041.
FULL = dict(epochs=3, batch_size=32, learning_rate=5e-5, sequence_length=128)
SAMPLE = dict(epochs=10, batch_size=8, learning_rate=1e-4, sequence_length=128)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_data_args(
        p, "eriktks/conll2003", "CoNLL-2003 files eng.train, eng.testa, eng.testb", "ner"
    )
    p.add_argument("--eval-split", default="test", choices=["validation", "test"])
    common.add_training_args(p, FULL, SAMPLE)
    args = p.parse_args(argv)
    return common.settle(args, FULL, SAMPLE, args.data_dir)


def label_list(tags):
    """ "O" first, then the entity tags sorted."""
    return ["O"] + sorted({t for sentence in tags for t in sentence} - {"O"})


def main(argv=None):
    args = parse_args(argv)
    keras.utils.set_random_seed(args.seed)  # head initialisation and dropout
    sentences, tags = load_conll2003("train", **common.source(args))
    labels = label_list(tags)  # from all the training data, before any cut
    sentences, tags = common.first((sentences, tags), args.max_train_examples)
    eval_sentences, eval_tags = common.first(
        load_conll2003(args.eval_split, **common.source(args)), args.max_eval_examples
    )
    index = {t: i for i, t in enumerate(labels)}
    unknown = sorted({t for s in eval_tags for t in s} - set(index))
    if unknown:
        raise SystemExit(f"the {args.eval_split} split has tags the training data lacks: {unknown}")
    model = kbert.BertTokenClassifier.from_preset(
        args.preset, num_classes=len(labels), **common.task_kwargs(args)
    )
    model.preprocessor.sequence_length = args.sequence_length
    order = common.epoch_order(len(sentences), args.epochs, args.seed)
    x, y, weights, _ = model.encode_words(
        common.take(sentences, order), [[index[t] for t in tags[i]] for i in order]
    )
    steps = -(-len(order) // args.batch_size)
    model.compile(learning_rate=args.learning_rate, num_train_steps=steps)
    start = time.time()
    model.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=args.batch_size,
        epochs=1,
        shuffle=False,
        verbose=args.verbose,
    )
    train_seconds = time.time() - start
    predicted = model.predict_words(eval_sentences, batch_size=128)
    predicted_tags = [[labels[i] if i >= 0 else "O" for i in row] for row in predicted]
    result = {
        "data": args.dataset or args.data_dir,
        "train_sentences": len(sentences),
        "eval_split": args.eval_split,
        "eval_sentences": len(eval_sentences),
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "train_seconds": round(train_seconds, 1),
        "labels": labels,
        "entity_f1": metrics.entity_f1(eval_tags, predicted_tags),
        "token_accuracy": float(
            np.mean([p == t for ps, ts in zip(predicted_tags, eval_tags) for p, t in zip(ps, ts)])
        ),
    }
    return common.finish(
        model, result, args.output_dir or os.path.join("runs", "ner"), quiet_keys=("labels",)
    )


if __name__ == "__main__":
    main()
