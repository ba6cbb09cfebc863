"""A fine-tuning step's time on JAX: `BertClassifier.fit` at one length.

    python benchmarks/finetune_step.py --length 80 --out step.json
    python benchmarks/finetune_step.py --length 384 --attention-dropout 0 --out step.json
    python benchmarks/finetune_step.py --length 80 --profile --out step.json
    python benchmarks/finetune_step.py --length 80 --compile-phases --out step.json
    python benchmarks/finetune_step.py --architecture bert_tiny --length 32 --out step.json
        (a smoke test of the script that runs on a CPU)

BERT-base (random weights, 30,522-token vocabulary) with a 2-class head,
bf16, `compile(learning_rate=2e-5, autotune=False)` (the programs a short
fit compiles), batch 32, `--steps` batches of `--length` tokens each
(real lengths drawn from length/2 to length), `bucket_lengths=False`,
and the step's own program (`jax_compile.FIRST_PROGRAMS = False`: no
loop programs). Reports the first `fit` (compilation included) and
`ms_per_step` of a second, identical `fit`. With `--profile`, a third
`fit` runs under `jax.profiler` and the GPU kernel time per step is split
by category as in `profile_step.py`, with the XLA op kinds. With
`--compile-phases`, XLA's own timers of the first `fit`'s compilations
(its log at verbosity 2 for the pass pipeline and the compiler driver)
give the seconds of each compiled program's HLO passes and code
generation, and the HLO passes that took longest over all of them.

Attention dropout 0.1 (BERT's recipe, kbert's default) takes the explicit
attention path on JAX; 0 takes cuDNN's flash attention
(`kbert.layers.attention`). Figures: benchmarks/RESULTS.md.
"""

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--architecture", default="bert_base")
    parser.add_argument("--length", type=int, default=80)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--attention-dropout", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compile-phases", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = "jax"
    if args.compile_phases:  # read when XLA loads: before jax is imported
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
        os.environ["TF_CPP_VMODULE"] = COMPILE_LOG_MODULES
    import jax
    import keras
    import numpy as np

    import kbert
    from kbert.backend import jax_compile

    jax_compile.FIRST_PROGRAMS = False
    log = XlaLog(args.compile_phases)  # from here: the random weights' programs too
    keras.utils.set_random_seed(0)
    backbone = kbert.BertBackbone.from_architecture(
        args.architecture,
        vocabulary_size=30522,
        dtype="mixed_bfloat16",
        dropout=args.dropout,
        attention_dropout=args.attention_dropout,
        max_sequence_length=512,
    )
    model = kbert.BertClassifier(backbone, num_classes=2, dropout=args.dropout)
    model.compile(learning_rate=2e-5, autotune=False)
    rng = np.random.default_rng(0)
    n, length = 32 * args.steps, args.length
    lengths = rng.integers(length // 2, length + 1, n)
    x = {
        "token_ids": rng.integers(1000, 30000, (n, length)).astype("int32"),
        "segment_ids": np.zeros((n, length), "int32"),
        "padding_mask": (np.arange(length)[None] < lengths[:, None]).astype("int32"),
    }
    y = rng.integers(0, 2, n)
    kwargs = dict(batch_size=32, epochs=1, verbose=0, shuffle=False, bucket_lengths=False)
    begin = time.perf_counter()
    model.fit(x, y, **kwargs)
    first = time.perf_counter() - begin
    log.stop()
    begin = time.perf_counter()
    model.fit(x, y, **kwargs)
    warm = time.perf_counter() - begin
    result = {
        "architecture": args.architecture,
        "length": length,
        "batch": 32,
        "dropout": args.dropout,
        "attention_dropout": args.attention_dropout,
        "device": str(jax.devices()[0].device_kind),
        "first_fit_seconds": first,
        "ms_per_step": 1e3 * warm / args.steps,
    }
    if args.compile_phases:
        result["compile_phases"] = compile_phases(log.text)
    if args.profile:
        result["profile"] = profile(model, x, y, kwargs, args.steps)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k not in ("profile", "compile_phases")}))
    for program in result.get("compile_phases", {}).get("programs", [])[:4]:
        print(json.dumps(program))


# XLA source files whose timers (`XLA_SCOPED_LOGGING_TIMER`) `--compile-phases` reads
COMPILE_LOG_MODULES = "hlo_pass_pipeline=2,gpu_compiler=2,cpu_compiler=2,nvptx_compiler=2"


class XlaLog:
    """From its making until `stop()`: what XLA's C++ writes to the process's
    standard error goes to a temporary file instead, then to `text` (when
    `on`)."""

    def __init__(self, on):
        self.on, self.text = on, ""
        if on:
            import tempfile

            sys.stderr.flush()
            self.file = tempfile.TemporaryFile(mode="w+b")
            self.saved = os.dup(2)
            os.dup2(self.file.fileno(), 2)

    def stop(self):
        if self.on:
            sys.stderr.flush()
            os.dup2(self.saved, 2)
            os.close(self.saved)
            self.file.seek(0)
            self.text = self.file.read().decode("utf-8", "replace")
            self.file.close()
            self.on = False


_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def compile_phases(log):
    """Seconds of each compiled program by phase (GPU: HLO passes and code
    generation; CPU: the whole compilation), with the HLO passes that took
    longest in the longest program, from XLA's timer lines ("<label> time:
    1.23 s (...)"). A pass's line comes before the line that ends its
    program's pass pipeline (GPU) or compilation (CPU)."""
    import re

    timer = re.compile(r"\] (.+?) time: ([\d.]+) (us|ms|s|m)\b")
    phase = re.compile(r"Compiler::(RunHloPasses|RunBackend) for (\S+)$")
    cpu = re.compile(r"^Compiling \[(\S+)\] for CPU")
    programs, pending = {}, collections.Counter()
    for line in log.splitlines():
        match = timer.search(line)
        if not match:
            continue
        label, seconds = match.group(1), float(match.group(2)) * _UNITS[match.group(3)]
        if label.startswith("HLO pass: "):
            pending[label[len("HLO pass: ") :]] += seconds
            continue
        gpu_phase, cpu_phase = phase.search(label), cpu.search(label)
        if not (gpu_phase or cpu_phase):
            continue
        if gpu_phase:
            name, key = gpu_phase.group(2), gpu_phase.group(1)
        else:
            name, key = cpu_phase.group(1), "total"
        entry = programs.setdefault(name, {"passes": collections.Counter()})
        entry[key] = entry.get(key, 0.0) + seconds
        if key != "RunBackend":
            entry["passes"] += pending
            pending = collections.Counter()
    rows = []
    for name, entry in programs.items():
        row = {"program": name}
        if "total" in entry:
            row["seconds"] = entry["total"]
        else:
            row["hlo_passes_s"] = entry.get("RunHloPasses", 0.0)
            row["backend_s"] = entry.get("RunBackend", 0.0)
            row["seconds"] = row["hlo_passes_s"] + row["backend_s"]
        row["longest_passes"] = [
            {"pass": p, "seconds": round(t, 3)} for p, t in entry["passes"].most_common(8)
        ]
        rows.append(row)
    rows.sort(key=lambda r: -r["seconds"])
    return {"programs": rows}


def profile(model, x, y, kwargs, steps):
    import tempfile

    import jax
    import profile_step

    trace_dir = tempfile.mkdtemp(prefix="finetune-step-trace-")
    jax.profiler.start_trace(trace_dir)
    begin = time.perf_counter()
    model.fit(x, y, **kwargs)
    wall = time.perf_counter() - begin
    jax.profiler.stop_trace()
    _, lines = profile_step.read_jax_trace(trace_dir)
    result = profile_step.gpu_summary(lines, wall, steps)
    if "XLA Ops" in lines:
        seconds, counts = collections.Counter(), collections.Counter()
        for name, duration, *_ in lines["XLA Ops"]:
            kind = name.split(".")[0].rstrip("0123456789_")
            seconds[kind] += duration
            counts[kind] += 1
        result["xla_op_kinds"] = [
            {"kind": k, "ms_per_step": 1e3 * v / steps, "calls_per_step": counts[k] / steps}
            for k, v in seconds.most_common(40)
        ]
    return result


if __name__ == "__main__":
    main()
