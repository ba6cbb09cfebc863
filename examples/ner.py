"""Fine-tune a BERT tagger on CoNLL-2003 NER and report entity-level F1.

    KERAS_BACKEND=jax python examples/ner.py
    python examples/ner.py --train-file eng.train --eval-file eng.testb --preset path/to/bert

Data: `../shared/data/conll2003/eng.{train,testa,testb}` by default (columns
`word POS chunk NER`, IOB1 tags). Each word's label goes on its first
WordPiece (the paper's set-up); sentences longer than `--sequence-length`
pieces are cut, and their cut words count as "O" predictions in the score.
Metric: micro entity F1 with the conlleval/seqeval rules on `--eval-file`
(default: the test set, eng.testb).
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import finetune_common as common  # noqa: E402

import kbert  # noqa: E402
from kbert import metrics  # noqa: E402
from kbert.data.finetuning import read_conll  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    data = os.path.join(common.SHARED_DATA, "conll2003")
    p.add_argument("--train-file", default=os.path.join(data, "eng.train"))
    p.add_argument("--eval-file", default=os.path.join(data, "eng.testb"))
    common.add_training_args(p, epochs=3)
    return p.parse_args(argv)


def label_list(tags):
    """ "O" first, then the entity tags sorted."""
    return ["O"] + sorted({t for sentence in tags for t in sentence} - {"O"})


def main(argv=None):
    args = parse_args(argv)
    sentences, tags = read_conll(args.train_file)
    eval_sentences, eval_tags = read_conll(args.eval_file)
    labels = label_list(tags)  # from the whole training file, before any cut
    if args.max_train_examples:
        sentences, tags = sentences[: args.max_train_examples], tags[: args.max_train_examples]
    if args.max_eval_examples:
        eval_sentences, eval_tags = (
            eval_sentences[: args.max_eval_examples],
            eval_tags[: args.max_eval_examples],
        )
    index = {t: i for i, t in enumerate(labels)}
    unknown = sorted({t for s in eval_tags for t in s} - set(index))
    if unknown:
        raise SystemExit(f"{args.eval_file} has tags not in the training data: {unknown}")
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
        "train_sentences": len(sentences),
        "eval_sentences": len(eval_sentences),
        "epochs": args.epochs,
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
