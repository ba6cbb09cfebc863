"""Working memory of one attention call with a sliding window, as XLA plans
it: "banded" against "explicit" (the dense masked reference) at several
lengths, from the compiled program's memory analysis (no run; any device,
a CPU included).

    KERAS_BACKEND=jax python benchmarks/long_attention_memory.py --output memory.json

Shapes: batch 1, 12 heads of 64 (BERT-base), window 512 with [CLS] global,
float32. Reported per length: XLA's temporary bytes for the forward pass
(MiB) of each implementation, and MiB per 1,000 tokens.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def temp_mib(name, length, heads, head_dim, window):
    import jax
    import numpy as np

    from kbert.layers import attention
    from kbert.layers.banded_attention import window_mask

    implementation = attention.ATTENTION_IMPLEMENTATIONS[name]
    no_dropout = attention.AttentionDropout(0.0, None)

    def call(q, k, v, padding):
        mask = window_mask(padding, window, 1)
        return implementation.attend(q, k, v, mask, 0.125, no_dropout)

    q = jax.ShapeDtypeStruct((1, length, heads, head_dim), np.float32)
    padding = jax.ShapeDtypeStruct((1, length), np.int32)
    compiled = jax.jit(call).lower(q, q, q, padding).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--implementations", nargs="+", default=["banded", "explicit"])
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    import keras

    if keras.backend.backend() != "jax":
        raise SystemExit("reads XLA's memory analysis: run with KERAS_BACKEND=jax")
    rows = []
    for length in args.lengths:
        row = {"length": length}
        for name in args.implementations:
            mib = temp_mib(name, length, args.heads, args.head_dim, args.window)
            row[f"{name}_temp_mib"] = round(mib, 1)
            row[f"{name}_mib_per_1k_tokens"] = round(mib / (length / 1000), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
