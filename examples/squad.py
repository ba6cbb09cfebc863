"""Fine-tune a BERT for extractive question answering (SQuAD v1.1 / v2.0) and report EM and F1.

    KERAS_BACKEND=jax python examples/squad.py           # the sample in examples/data
    KERAS_BACKEND=jax python examples/squad.py --dataset rajpurkar/squad
    python examples/squad.py --dataset rajpurkar/squad_v2 --version-2
    python examples/squad.py --train-file train-v1.1.json --predict-file dev-v1.1.json

Data: with `--dataset`, questions through Hugging Face `datasets` (train and
validation splits); otherwise SQuAD JSON files, by default a sample that
ships with kbert: 147 training and 57 evaluation questions from XQuAD-en
(SQuAD v1.1 dev paragraphs), whole articles in each, so no paragraph is in
both: it shows the recipe end to end, too few questions to learn the task.
Contexts longer than `--sequence-length` become windows `--doc-stride`
tokens apart. Metrics: SQuAD exact match and F1 with the official answer
normalisation. With `--version-2`, questions may have no answer: the model
answers "" when the [CLS] score beats the best span by more than
`--null-score-threshold`.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import finetune_common as common  # noqa: E402
import keras  # noqa: E402

import kbert  # noqa: E402
from kbert import metrics  # noqa: E402
from kbert.data.sources import load_squad  # noqa: E402

FULL = dict(epochs=3, batch_size=32, learning_rate=5e-5, sequence_length=384)
SAMPLE = FULL  # 147 questions are too few to learn the task: the sample checks the pipeline


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--dataset",
        default=None,
        help="load through Hugging Face `datasets`, e.g. rajpurkar/squad: downloaded once into "
        "its cache (HF_DATASETS_CACHE); HF_DATASETS_OFFLINE=1 reads the cache only",
    )
    p.add_argument("--train-file", default=os.path.join(common.SAMPLES, "squad", "train.json"))
    p.add_argument("--predict-file", default=os.path.join(common.SAMPLES, "squad", "dev.json"))
    p.add_argument("--doc-stride", type=int, default=128)
    p.add_argument("--max-query-length", type=int, default=64)
    p.add_argument("--max-answer-length", type=int, default=30)
    p.add_argument("--n-best-size", type=int, default=20)
    p.add_argument("--version-2", action="store_true")
    p.add_argument("--null-score-threshold", type=float, default=0.0)
    common.add_training_args(p, FULL, SAMPLE)
    args = p.parse_args(argv)
    return common.settle(args, FULL, SAMPLE, args.train_file)


def load(args):
    if args.dataset:
        return [load_squad(split, dataset=args.dataset) for split in ("train", "validation")]
    return [load_squad(data_file=path) for path in (args.train_file, args.predict_file)]


def main(argv=None):
    args = parse_args(argv)
    keras.utils.set_random_seed(args.seed)  # head initialisation and dropout
    train, evaluation = load(args)
    train, evaluation = train[: args.max_train_examples], evaluation[: args.max_eval_examples]
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
        "data": args.dataset or [args.train_file, args.predict_file],
        "train_questions": len(train),
        "train_features": int(len(features.example_index)),
        "eval_questions": len(evaluation),
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
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
