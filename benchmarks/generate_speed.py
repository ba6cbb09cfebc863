"""`generate` speed of one tree: a random BERT-base-sized bert2bert in
bf16 (`mixed_bfloat16`), batch 64, 64-token sources, 64 new tokens,
greedy and 4 beams; for before/after comparisons of decoding changes,
run from each tree's root in one device call, alternating.

    cd TREE && KERAS_BACKEND=torch python benchmarks/generate_speed.py --transformers \
        --ids /tmp/ids_TREE --output /tmp/generate_TREE.json
    python benchmarks/generate_speed.py --size tiny --batch-size 4    # a CPU check

Each `generate` is timed after a first call that compiles or captures
(reported as first_s): the best of `--repeats`. `--transformers` adds
transformers' `EncoderDecoderModel.generate` on the same weights (bf16,
its cache) in the same process; `--ids PREFIX` saves the generated ids
(PREFIX_b1.npy, PREFIX_b4.npy) to check that two trees decode alike.
`benchmarks/seq2seq.py speed` times the same model with fine-tuning too.
"""

import argparse
import importlib.util
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _seq2seq_benchmark():
    """benchmarks/seq2seq.py as a module (its model sizes and transformers'
    generate), loaded by path: `examples/seq2seq.py` has the same name."""
    spec = importlib.util.spec_from_file_location(
        "seq2seq_benchmark", os.path.join(ROOT, "benchmarks", "seq2seq.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", default="base", choices=["base", "tiny"])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--source-length", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--transformers", action="store_true")
    p.add_argument("--ids", default=None, help="save the generated ids under this prefix")
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


def _sync():
    import keras

    if keras.backend.backend() == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()


def _timed(fn, repeats):
    start = time.perf_counter()
    out = fn()
    _sync()
    first = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - start)
    return first, best, out


def main(argv=None):
    args = parse_args(argv)
    import keras

    import kbert
    from kbert.generation.runner import decoding_path, decoding_stats

    benchmark = _seq2seq_benchmark()
    sizes = benchmark.BASE if args.size == "base" else benchmark.TINY
    keras.utils.set_random_seed(0)
    backbone = kbert.BertBackbone(
        **sizes, dropout=0.0, attention_dropout=0.0, dtype="mixed_bfloat16"
    )
    model = kbert.BertSeq2SeqLM(backbone, start_token_id=2, end_token_id=3)
    rng = np.random.default_rng(0)
    shape = (args.batch_size, args.source_length)
    x = {
        "encoder_token_ids": rng.integers(5, sizes["vocabulary_size"], shape).astype("int32"),
        "encoder_padding_mask": np.ones(shape, "int32"),
    }
    max_length = args.new_tokens + 1
    result = {"backend": keras.backend.backend(), "args": vars(args), "kbert": {}}
    for beams in (1, 4):
        first, best, ids = _timed(
            lambda: model.generate(x, max_length=max_length, num_beams=beams), args.repeats
        )
        result["kbert"][f"beams{beams}"] = {
            "first_s": round(first, 3),
            "best_s": round(best, 4),
            "output_length": int(np.asarray(ids).shape[1]),
        }
        if args.ids:
            np.save(f"{args.ids}_b{beams}.npy", np.asarray(ids))
    result["decoding_path"] = decoding_path(model)[0]
    result["decoding_stats"] = decoding_stats(model)
    if args.transformers:
        _, _, _, theirs = benchmark.transformers_generator(model, x, bfloat16=True)
        result["transformers"] = {}
        for beams in (1, 4):
            first, best, _ = _timed(lambda: theirs(max_length, beams), args.repeats)
            result["transformers"][f"beams{beams}"] = {
                "first_s": round(first, 3),
                "best_s": round(best, 4),
            }
            result["kbert"][f"beams{beams}"]["speedup"] = round(
                best / result["kbert"][f"beams{beams}"]["best_s"], 2
            )
    print(json.dumps(result), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
