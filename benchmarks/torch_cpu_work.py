"""CPU work per call of kbert's torch backend against transformers on the
models of `benchmarks/mobilebert.py`: with one intra-op thread, the process
CPU time of a call is the work it does, whatever the wait for a shared
core; wall time is reported alongside.

    OMP_NUM_THREADS=1 KERAS_BACKEND=torch python benchmarks/torch_cpu_work.py \
        kbert --workdir DIR [--models mobilebert minilm]

DIR: a `benchmarks/mobilebert.py --workdir DIR` directory (its `prepare`
step writes one transformers directory per model). `kbert`: kbert's
`BertClassifier.predict_on_batch`; `transformers`: the model and
`BertTokenizer`, as `benchmarks/mobilebert.py` runs them. float32, then int8
(kbert's `quantize("int8")`, torch's dynamic quantization). Prints one
`RESULT {json}` line: median CPU and wall ms per call at batch 1 and 32.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from mobilebert import DATA, sentences  # noqa: E402


def classifier(system, directory):
    """(classify(batch), quantize()) for one model directory."""
    import torch

    if system == "kbert":
        import kbert

        model = kbert.BertClassifier.from_preset(directory, num_classes=2)
        model.preprocessor.sequence_length = 128
        return model.predict_on_batch, lambda: model.quantize("int8")
    import transformers

    tokenizer = transformers.BertTokenizer.from_pretrained(directory)
    held = [transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()]

    def classify(batch):
        with torch.inference_mode():
            x = tokenizer(batch, padding=True, truncation=True, max_length=128, return_tensors="pt")
            return held[0](**x).logits.numpy()

    def quantize():
        held[0] = torch.ao.quantization.quantize_dynamic(
            held[0], {torch.nn.Linear}, dtype=torch.qint8
        )

    return classify, quantize


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("system", choices=["kbert", "transformers"])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--data", default=DATA)
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--models", nargs="+", default=["mobilebert", "minilm"])
    args = parser.parse_args()
    import torch

    texts = sentences(args.data, args.sentences)
    out = {"system": args.system, "threads": torch.get_num_threads()}
    out["load_average"] = os.getloadavg()[0]
    for name in args.models:
        classify, quantize = classifier(args.system, os.path.join(args.workdir, name))
        for kind in ("float32", "int8"):
            if kind == "int8":
                quantize()
            for size in (1, 32):
                batches = [texts[i : i + size] for i in range(0, len(texts), size)][:16]
                classify(batches[0])
                cpu, wall = [], []
                for batch in batches:
                    c, w = time.process_time(), time.perf_counter()
                    classify(batch)
                    cpu.append(time.process_time() - c)
                    wall.append(time.perf_counter() - w)
                out[f"{name}_{kind}_b{size}"] = {
                    "cpu_ms_median": 1000 * statistics.median(cpu),
                    "wall_ms_median": 1000 * statistics.median(wall),
                    "calls": len(cpu),
                }
    out["load_average_after"] = os.getloadavg()[0]
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
