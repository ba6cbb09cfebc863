"""Fine-tune a BERT for extractive question answering (SQuAD v1.1 / v2.0 JSON).

    KERAS_BACKEND=jax python examples/squad.py
    python examples/squad.py --train-file train-v1.1.json --predict-file dev-v1.1.json
    python examples/squad.py --train-file train-v2.0.json --predict-file dev-v2.0.json --version-2

Default data: XQuAD-en (`../shared/data/squad/xquad.en.json`, 48 articles,
1,190 questions from the SQuAD v1.1 dev set) split by article: the first
`--train-articles` (32) train, the remaining 16 are evaluated, so no
paragraph is in both. Contexts longer than `--sequence-length` become
windows `--doc-stride` tokens apart. Metrics: SQuAD exact match and F1 with
the official answer normalisation. With `--version-2`, questions may have no
answer: the model answers "" when the [CLS] score beats the best span by
more than `--null-score-threshold`.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import finetune_common as common  # noqa: E402

import kbert  # noqa: E402
from kbert import metrics  # noqa: E402
from kbert.data.finetuning import read_squad  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--train-file", default=os.path.join(common.SHARED_DATA, "squad", "xquad.en.json")
    )
    p.add_argument(
        "--predict-file", default=None, help="default: the articles of --train-file not trained on"
    )
    p.add_argument(
        "--train-articles", type=int, default=32, help="with one file: articles used for training"
    )
    p.add_argument("--doc-stride", type=int, default=128)
    p.add_argument("--max-query-length", type=int, default=64)
    p.add_argument("--max-answer-length", type=int, default=30)
    p.add_argument("--n-best-size", type=int, default=20)
    p.add_argument("--version-2", action="store_true")
    p.add_argument("--null-score-threshold", type=float, default=0.0)
    common.add_training_args(p, epochs=3, sequence_length=384, learning_rate=5e-5)
    return p.parse_args(argv)


def load(args):
    examples = read_squad(args.train_file)
    if args.predict_file:
        return examples, read_squad(args.predict_file)
    titles = list(dict.fromkeys(e["title"] for e in examples))
    train_titles = set(titles[: args.train_articles])
    if len(train_titles) == len(titles):
        raise SystemExit(
            f"--train-articles {args.train_articles} leaves nothing to evaluate ({len(titles)} articles)"
        )
    return (
        [e for e in examples if e["title"] in train_titles],
        [e for e in examples if e["title"] not in train_titles],
    )


def main(argv=None):
    args = parse_args(argv)
    train, evaluation = load(args)
    if args.max_train_examples:
        train = train[: args.max_train_examples]
    if args.max_eval_examples:
        evaluation = evaluation[: args.max_eval_examples]
    model = kbert.BertQuestionAnswerer.from_preset(
        args.preset,
        doc_stride=args.doc_stride,
        max_query_length=args.max_query_length,
        max_answer_length=args.max_answer_length,
        n_best_size=args.n_best_size,
        null_score_threshold=args.null_score_threshold if args.version_2 else None,
        **common.task_kwargs(args),
    )
    model.preprocessor.sequence_length = args.sequence_length
    features = model.prepare_features(
        [e["question"] for e in train],
        [e["context"] for e in train],
        [e["answers"][0] if e["answers"] else None for e in train],
    )
    order = common.epoch_order(len(features.example_index), args.epochs, args.seed)
    steps = -(-len(order) // args.batch_size)
    model.compile(learning_rate=args.learning_rate, num_train_steps=steps)
    start = time.time()
    model.fit(
        common.take(features.x, order),
        common.take(features.y, order),
        batch_size=args.batch_size,
        epochs=1,
        shuffle=False,
        verbose=args.verbose,
    )
    train_seconds = time.time() - start
    answers = model.predict_answers(
        [e["question"] for e in evaluation], [e["context"] for e in evaluation], batch_size=64
    )
    scores = metrics.squad_scores(answers, [[a["text"] for a in e["answers"]] for e in evaluation])
    result = {
        "train_questions": len(train),
        "train_features": int(len(features.example_index)),
        "eval_questions": len(evaluation),
        "epochs": args.epochs,
        "train_seconds": round(train_seconds, 1),
        **scores,
    }
    output_dir = args.output_dir or os.path.join("runs", "squad")
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "predictions.json"), "w") as f:
        json.dump(
            {e["id"]: a for e, a in zip(evaluation, answers)}, f, indent=2, ensure_ascii=False
        )
    return common.finish(model, result, output_dir)


if __name__ == "__main__":
    main()
