"""Pre-training input pipeline throughput on this machine: sequences/s of
`(x, y)` batches at seq 128 from TFRecords and in dynamic mode, and of
creating the TFRecords in one process.

    python benchmarks/data_throughput.py [--output data.json]

Makes its own data from the shipped corpus (examples/data, WikiText-2
validation). Current figures: benchmarks/RESULTS.md.
"""

import argparse
import json
import os
import platform
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(dataset, batches, batch_size):
    iterator = iter(dataset)
    next(iterator)  # start-up (file open, first shuffle fill) is not throughput
    start = time.perf_counter()
    for _ in range(batches):
        x, y = next(iterator)
    x["token_ids"].numpy()
    return batches * batch_size / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--output", default=os.path.join(HERE, "results", "data_cpu.json"))
    args = parser.parse_args()

    import kbert
    from kbert.data import MaskingConfig

    corpus = os.path.join(HERE, "..", "examples", "data", "wikitext-2-valid.tokens.txt")
    work = tempfile.mkdtemp()
    vocab = os.path.join(work, "vocab.txt")
    kbert.tokenizers.train_wordpiece_vocabulary([corpus], 8000, output=vocab)
    tokenizer = kbert.BertTokenizer(vocab)
    masking = MaskingConfig(max_seq_length=128, max_predictions_per_seq=20)
    start = time.perf_counter()
    manifest = kbert.data.create_pretraining_data(
        [corpus],
        tokenizer,
        os.path.join(work, "data"),
        masking=masking,
        dupe_factor=5,
        format="wikitext",
        progress=False,
    )
    creation = manifest["instances"] / (time.perf_counter() - start)
    files = os.path.join(work, "data", "*.tfrecord")
    static = kbert.data.pretraining_dataset(files, args.batch_size, 128, 20, seed=0, repeat=True)
    documents = kbert.data.tokenize_documents(
        kbert.data.read_documents([corpus], format="wikitext"), tokenizer
    )
    dynamic = kbert.data.dynamic_pretraining_dataset(
        documents, tokenizer, args.batch_size, masking, seed=0, repeat=True
    )
    report = {
        "benchmark": "pre-training input pipeline, seq 128, 20 predictions",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "batch_size": args.batch_size,
        "sequences_per_second": {
            "tfrecords": measure(static, args.batches, args.batch_size),
            "dynamic": measure(dynamic, max(10, args.batches // 10), args.batch_size),
            "static_creation_single_process": creation,
        },
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
