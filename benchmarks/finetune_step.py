"""A fine-tuning step's time on JAX: `BertClassifier.fit` at one length.

    python benchmarks/finetune_step.py --length 80 --out step.json
    python benchmarks/finetune_step.py --length 384 --attention-dropout 0 --out step.json
    python benchmarks/finetune_step.py --length 80 --profile --out step.json
    python benchmarks/finetune_step.py --architecture bert_tiny --length 32 --out step.json
        (a smoke test of the script that runs on a CPU)

BERT-base (random weights, 30,522-token vocabulary) with a 2-class head,
bf16, `compile(learning_rate=2e-5, autotune=False)` (the programs a short
fit compiles), batch 32, `--steps` batches of `--length` tokens each
(real lengths drawn from length/2 to length), `bucket_lengths=False`,
and the step's own program (`jax_compile.FIRST_PROGRAMS = False`: no
loop programs). Reports the first `fit` (compilation included) and
`ms_per_step` of a second, identical `fit`. With `--profile`, a third
`fit` runs under `jax.profiler` and the GPU kernel time per step is split
by category as in `profile_step.py`, with the XLA op kinds.

Attention dropout 0.1 (BERT's recipe, kbert's default) takes the explicit
attention path on JAX; 0 takes cuDNN's flash attention
(`kbert.layers.attention`). Figures: benchmarks/RESULTS.md.
"""

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--architecture", default="bert_base")
    parser.add_argument("--length", type=int, default=80)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--attention-dropout", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import keras
    import numpy as np

    import kbert
    from kbert.backend import jax_compile

    jax_compile.FIRST_PROGRAMS = False
    keras.utils.set_random_seed(0)
    backbone = kbert.BertBackbone.from_architecture(
        args.architecture,
        vocabulary_size=30522,
        dtype="mixed_bfloat16",
        dropout=args.dropout,
        attention_dropout=args.attention_dropout,
        max_sequence_length=512,
    )
    model = kbert.BertClassifier(backbone, num_classes=2, dropout=args.dropout)
    model.compile(learning_rate=2e-5, autotune=False)
    rng = np.random.default_rng(0)
    n, length = 32 * args.steps, args.length
    lengths = rng.integers(length // 2, length + 1, n)
    x = {
        "token_ids": rng.integers(1000, 30000, (n, length)).astype("int32"),
        "segment_ids": np.zeros((n, length), "int32"),
        "padding_mask": (np.arange(length)[None] < lengths[:, None]).astype("int32"),
    }
    y = rng.integers(0, 2, n)
    kwargs = dict(batch_size=32, epochs=1, verbose=0, shuffle=False, bucket_lengths=False)
    begin = time.perf_counter()
    model.fit(x, y, **kwargs)
    first = time.perf_counter() - begin
    begin = time.perf_counter()
    model.fit(x, y, **kwargs)
    warm = time.perf_counter() - begin
    result = {
        "architecture": args.architecture,
        "length": length,
        "batch": 32,
        "dropout": args.dropout,
        "attention_dropout": args.attention_dropout,
        "device": str(jax.devices()[0].device_kind),
        "first_fit_seconds": first,
        "ms_per_step": 1e3 * warm / args.steps,
    }
    if args.profile:
        result["profile"] = profile(model, x, y, kwargs, args.steps)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "profile"}))


def profile(model, x, y, kwargs, steps):
    import tempfile

    import jax
    import profile_step

    trace_dir = tempfile.mkdtemp(prefix="finetune-step-trace-")
    jax.profiler.start_trace(trace_dir)
    begin = time.perf_counter()
    model.fit(x, y, **kwargs)
    wall = time.perf_counter() - begin
    jax.profiler.stop_trace()
    _, lines = profile_step.read_jax_trace(trace_dir)
    result = profile_step.gpu_summary(lines, wall, steps)
    if "XLA Ops" in lines:
        seconds, counts = collections.Counter(), collections.Counter()
        for name, duration, *_ in lines["XLA Ops"]:
            kind = name.split(".")[0].rstrip("0123456789_")
            seconds[kind] += duration
            counts[kind] += 1
        result["xla_op_kinds"] = [
            {"kind": k, "ms_per_step": 1e3 * v / steps, "calls_per_step": counts[k] / steps}
            for k, v in seconds.most_common(40)
        ]
    return result


if __name__ == "__main__":
    main()
