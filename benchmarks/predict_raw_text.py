"""`Task.predict` on raw text: length buckets versus one fixed length.

    python benchmarks/predict_raw_text.py --data path/to/glue/SST-2/dev.tsv [--output predict.json]

`BertTextEmbedder.predict(texts)` (the real all-MiniLM-L6-v2, SST-2 dev,
batch 32) runs each batch cut to its longest sequence rounded up to 16;
the baseline is Keras' `predict` on the same preprocessed inputs at the
preprocessor's `sequence_length` (128). Each backend in its own process;
the best of `--repeats` timed passes after one warm-up pass (which compiles
every bucket on JAX and TensorFlow). Current figures: benchmarks/RESULTS.md.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cpu_inference import DATA, model_dir, sentences  # noqa: E402


def child(texts, repeats):
    import keras
    import numpy as np

    import kbert

    embedder = kbert.BertTextEmbedder.from_preset(model_dir(), pooling="mean", normalize=True)
    fixed_inputs = embedder.preprocess_samples(texts)

    def bucketed():
        return embedder.predict(texts, batch_size=32)

    def fixed():
        return keras.Model.predict(embedder, fixed_inputs, batch_size=32, verbose=0)

    result = {}
    for name, run in (("bucketed", bucketed), ("fixed_128", fixed)):
        out = run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = run()
            times.append(time.perf_counter() - start)
        result[name] = {
            "seconds": min(times),
            "sentences_per_second": len(texts) / min(times),
            "output": out,
        }
    difference = float(
        np.abs(result["bucketed"].pop("output") - result["fixed_128"].pop("output")).max()
    )
    result["max_abs_difference"] = difference
    result["speedup"] = (
        result["bucketed"]["sentences_per_second"] / result["fixed_128"]["sentences_per_second"]
    )
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=DATA, help="GLUE SST-2 dev.tsv")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backends", nargs="+", default=["jax", "torch", "tensorflow"])
    parser.add_argument(
        "--output", default=os.path.join(HERE, "results", "predict_raw_text_cpu.json")
    )
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    texts = sentences(args.data)
    if args.child:
        print("RESULT " + json.dumps(child(texts, args.repeats)))
        return
    results = {}
    for backend in args.backends:
        env = dict(os.environ, KERAS_BACKEND=backend, CUDA_VISIBLE_DEVICES="")
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                "--data",
                args.data,
                "--repeats",
                str(args.repeats),
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if not lines:
            results[backend] = {"error": proc.stderr[-1500:]}
            print(backend, "FAILED", proc.stderr[-800:])
            continue
        r = results[backend] = json.loads(lines[-1][7:])
        print(
            f"{backend:11s} bucketed {r['bucketed']['sentences_per_second']:7.0f} sentences/s, "
            f"fixed 128 {r['fixed_128']['sentences_per_second']:7.0f} ({r['speedup']:.2f}x), "
            f"max |difference| {r['max_abs_difference']:.1e}"
        )
    report = {
        "benchmark": "BertTextEmbedder.predict on raw SST-2 dev sentences "
        "(all-MiniLM-L6-v2, batch 32): "
        "length buckets of 16 vs fixed length 128",
        "sentences": len(texts),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "results": results,
    }
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
