"""Where a pre-training step's GPU time goes: kernel time by category.

    python benchmarks/profile_step.py --backend jax --config base128 --out prof.json
    python benchmarks/profile_step.py --backend torch --config base128 --out prof.json
    python benchmarks/profile_step.py --backend hf --config base128 --out prof.json

JAX: `jax.profiler` traces one execution of `--steps` training steps of
`BertPreTrainer` (the same model, shapes and compile options as
`gpu_pretrain.py`), parsed with `jax.profiler.ProfileData`. torch (the kbert
torch backend) and hf (transformers eager): `torch.profiler`. Reports wall
time per step, GPU busy time per step, and the busy time split by kernel
category (matrix products, attention, normalisation/elementwise fusions,
reductions, copies, optimizer ...) with the top kernels, the GPU's idle time
between kernels by gap length (JAX), and the host's busiest events, so a
claim like "bound by X" can be checked. Current figures: benchmarks/RESULTS.md.
"""

import argparse
import collections
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_pretrain  # noqa: E402

CATEGORIES = (  # first match wins; matched against the lower-cased kernel name
    ("attention", r"fmha|flash|cudnn|attention|sdpa|efficient_attention"),
    (
        "matmul",
        r"gemm|cublas|cutlass|matmul|sm90_xmma|xmma|nvjet|triton_gemm|__dot|dot_general|\bdot\b|wgmma",
    ),
    ("scatter/gather", r"scatter|gather|index|embedding"),
    ("optimizer", r"adam|foreach|multi_tensor|optimizer"),
    ("reduction", r"reduce|reduction|norm|softmax|sum"),
    ("copy/transpose", r"copy|transpose|memcpy|memset|concat|cat_|slice"),
    ("rng/dropout", r"rng|random|philox|threefry|dropout|bernoulli"),
)


def category(name):
    low = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, low):
            return label
    return "elementwise/other fusion"


def summarize(kernels, wall_s, steps):
    """kernels: list of (name, seconds) of GPU kernels over `steps` steps."""
    by_name = collections.Counter()
    counts = collections.Counter()
    for name, seconds in kernels:
        by_name[name] += seconds
        counts[name] += 1
    busy = sum(by_name.values())
    by_cat = collections.Counter()
    for name, seconds in by_name.items():
        by_cat[category(name)] += seconds
    return {
        "steps": steps,
        "wall_ms_per_step": 1e3 * wall_s / steps,
        "gpu_busy_ms_per_step": 1e3 * busy / steps,
        "gpu_busy_fraction": busy / wall_s if wall_s else None,
        "kernels_per_step": sum(counts.values()) / steps,
        "by_category_ms_per_step": {k: 1e3 * v / steps for k, v in by_cat.most_common()},
        "top_kernels": [
            {
                "name": n[:160],
                "ms_per_step": 1e3 * s / steps,
                "calls_per_step": counts[n] / steps,
                "category": category(n),
            }
            for n, s in by_name.most_common(40)
        ],
    }


def idle_gaps(intervals, steps):
    """intervals: (start_ns, end_ns[, name]) of every kernel on every stream. The
    time between busy periods (their union), per step, by gap length: many
    short gaps are launch latency between kernels; a few long ones are the
    host (or a transfer) holding the GPU back."""
    intervals = sorted(intervals)
    gaps, around = [], []
    end = intervals[0][1] if intervals else 0
    last = intervals[0][2:] if intervals else ()
    for start, stop, *name in intervals[1:]:
        if start > end:
            gaps.append(start - end)
            around.append((start - end, last, tuple(name)))
        if stop >= end:
            end, last = stop, tuple(name)
    bins = (
        ("<2us", 2e3),
        ("2-10us", 1e4),
        ("10-100us", 1e5),
        ("0.1-1ms", 1e6),
        (">1ms", float("inf")),
    )
    totals = {label: [0, 0.0] for label, _ in bins}
    for gap in gaps:
        label = next(label for label, limit in bins if gap < limit)
        totals[label][0] += 1
        totals[label][1] += gap
    return {
        "span_ms_per_step": (end - intervals[0][0]) / 1e6 / steps if intervals else 0.0,
        "idle_ms_per_step": sum(gaps) / 1e6 / steps,
        "by_length": {
            label: {"gaps_per_step": n / steps, "ms_per_step": ns / 1e6 / steps}
            for label, (n, ns) in totals.items()
        },
        "longest_ms": [g / 1e6 for g in sorted(gaps, reverse=True)[:10]],
        # between which kernels the GPU waits 0.1-1 ms (the fit's start and end are longer)
        "waits": [
            {"ms": g / 1e6, "after": a[0][:100] if a else "", "before": b[0][:100] if b else ""}
            for g, a, b in sorted(around, reverse=True)
            if 1e5 <= g < 1e6
        ][:40],
    }


def read_jax_trace(trace_dir):
    """The newest `jax.profiler` trace under `trace_dir`: (its ProfileData,
    {line name: [(event name, seconds, start_ns, end_ns)]} of GPU 0)."""
    import jax

    paths = [
        os.path.join(d, f)
        for d, _, fs in os.walk(trace_dir)
        for f in fs
        if f.endswith(".xplane.pb")
    ]
    data = jax.profiler.ProfileData.from_file(max(paths, key=os.path.getmtime))
    lines = {}
    for plane in data.planes:
        if plane.name.startswith("/device:GPU:0"):
            for line in plane.lines:
                lines[line.name] = [
                    (e.name, e.duration_ns / 1e9, e.start_ns, e.end_ns) for e in line.events
                ]
    return data, lines


def gpu_summary(lines, wall, steps):
    """`summarize` of GPU 0's kernels (`read_jax_trace` lines) over `steps`
    steps in `wall` seconds, with the idle gaps and the XLA-op view."""
    # Kernels are on the "Stream #..." lines; "XLA Ops" repeats the same time
    # per HLO op (fusion names), kept as a second view.
    kernels = [k for name, events in lines.items() if name.startswith("Stream") for k in events]
    result = summarize([k[:2] for k in kernels], wall, steps)
    result["idle"] = idle_gaps([(k[2], k[3], k[0]) for k in kernels], steps)
    if "XLA Ops" in lines:
        result["xla_ops"] = summarize([k[:2] for k in lines["XLA Ops"]], wall, steps)["top_kernels"]
    result["gpu_lines"] = {name: len(events) for name, events in lines.items()}
    return result


def profile_jax(args, arch, t, b, p):
    import jax
    import keras
    import numpy as np

    import kbert

    keras.config.set_dtype_policy("mixed_bfloat16")
    backbone = kbert.BertBackbone.from_architecture(
        arch,
        max_sequence_length=512,
        attention_dropout=args.attention_dropout,
        dtype="mixed_bfloat16",
        dropout=args.dropout,
    )
    model = kbert.BertPreTrainer(backbone)
    model.compile(
        optimizer=kbert.training.create_optimizer(1e-4, 10_000, 100),
        steps_per_execution=args.steps,
        jit_compile=True,
    )
    x, y = gpu_pretrain.batch(t, b, p)
    xs = {k: np.concatenate([v] * args.steps) for k, v in x.items()}
    ys = {k: np.concatenate([v] * args.steps) for k, v in y.items()}
    for _ in range(2):
        model.fit(xs, ys, batch_size=b, epochs=1, verbose=0, shuffle=False)
    trace_dir = os.path.join(args.trace_dir or "/tmp", "jax_trace")
    jax.profiler.start_trace(trace_dir)
    start = time.perf_counter()
    model.fit(xs, ys, batch_size=b, epochs=1, verbose=0, shuffle=False)
    wall = time.perf_counter() - start
    jax.profiler.stop_trace()
    data, lines = read_jax_trace(trace_dir)
    host = collections.Counter()
    host_calls = collections.Counter()
    for plane in data.planes:
        if plane.name.startswith(
            "/host:CPU"
        ):  # what the host spends its time in (blocking waits show here)
            for line in plane.lines:
                for e in line.events:
                    host[(line.name[:40], e.name[:120])] += e.duration_ns / 1e6
                    host_calls[(line.name[:40], e.name[:120])] += 1
    result = gpu_summary(lines, wall, args.steps)
    result["host_top_ms_per_step"] = [
        {
            "thread": k[0],
            "event": k[1],
            "ms_per_step": v / args.steps,
            "calls_per_step": host_calls[k] / args.steps,
        }
        for k, v in host.most_common(40)
    ]
    return result


def profile_torch(args, arch, t, b, p, hf):
    import torch
    from torch.profiler import ProfilerActivity, profile

    if hf:
        step = gpu_pretrain.hf_train_step(arch, t, b, p)
    else:
        import keras

        import kbert

        keras.config.set_dtype_policy("mixed_bfloat16")
        backbone = kbert.BertBackbone.from_architecture(
            arch,
            max_sequence_length=512,
            attention_dropout=args.attention_dropout,
            dtype="mixed_bfloat16",
            dropout=args.dropout,
        )
        model = kbert.BertPreTrainer(backbone)
        model.compile(
            optimizer=kbert.training.create_optimizer(1e-4, 10_000, 100), jit_compile=False
        )
        x, y = gpu_pretrain.batch(t, b, p)
        xt = {k: torch.tensor(v).cuda() for k, v in x.items()}
        yt = {k: torch.tensor(v).cuda() for k, v in y.items()}
        model.train_on_batch(xt, yt)

        def step():
            # What fit runs per batch. fit converts the logs to Python on a
            # callback thread; train_on_batch(return_dict=True) would do it
            # here, a host sync per log value that the profile would count.
            model.train_step((xt, yt))

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if args.sync_debug:  # where the host waits for the GPU, by Python stack
        import traceback
        import warnings

        sites = collections.Counter()

        def record(message, category, filename, lineno, file=None, line=None):
            frames = [f for f in traceback.extract_stack()[:-2] if "warnings" not in f.filename]
            sites[
                " <- ".join(
                    f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames[-6:])
                )
            ] += 1

        warnings.showwarning = record
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        step()
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        return {"syncs_per_step": sum(sites.values()), "sync_sites": sites.most_common(30)}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [
        (e.name, e.device_time_total / 1e6)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    result = summarize(kernels, wall, args.steps)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    result["cpu_ops_table"] = table
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["jax", "torch", "hf"], required=True)
    parser.add_argument("--config", default="base128", choices=list(gpu_pretrain.CONFIGS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--trace-dir", default=None)
    parser.add_argument(
        "--sync-debug", action="store_true", help="torch: list the host-device syncs of one step"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # hf imports kbert only for the architecture sizes; torch keeps it off TF.
    os.environ["KERAS_BACKEND"] = "torch" if args.backend == "hf" else args.backend
    arch, t, b, p = gpu_pretrain.CONFIGS[args.config]
    if args.backend == "jax":
        result = profile_jax(args, arch, t, b, p)
    else:
        result = profile_torch(args, arch, t, b, p, hf=args.backend == "hf")
    if args.sync_debug:
        print(json.dumps(result, indent=1))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        return
    flops = gpu_pretrain.train_flops_per_sequence(arch, t, p)
    result.update(
        config=args.config,
        backend=args.backend,
        dropout=args.dropout,
        attention_dropout=args.attention_dropout,
        seq_per_s=b / (result["wall_ms_per_step"] / 1e3),
        model_tflops=flops * b / (result["wall_ms_per_step"] / 1e3) / 1e12,
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"{args.backend} {args.config}: {result['wall_ms_per_step']:.1f} ms/step wall, "
        f"{result['gpu_busy_ms_per_step']:.1f} ms GPU busy"
    )
    if "idle" in result:
        idle = result["idle"]
        print(
            f"  idle between kernels {idle['idle_ms_per_step']:.2f} ms/step: "
            + ", ".join(
                f"{k} {v['gaps_per_step']:.0f} gaps {v['ms_per_step']:.2f} ms"
                for k, v in idle["by_length"].items()
            )
            + f"; longest {[round(g, 2) for g in idle['longest_ms'][:5]]} ms"
        )
    for k, v in result["by_category_ms_per_step"].items():
        print(f"  {k:28s} {v:7.2f} ms")
    for k in result["top_kernels"][:15]:
        print(
            f"  {k['ms_per_step']:7.2f} ms x{k['calls_per_step']:5.1f} "
            f"{k['category']:14s} {k['name'][:90]}"
        )


if __name__ == "__main__":
    main()
