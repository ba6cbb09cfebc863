"""int8 inference on one GPU: BERT-base `BertClassifier.predict` in bf16
against the same model after `model.quantize("int8")`, per Keras backend,
and transformers (bf16, eager and torch.compile) on the same shapes.

    python benchmarks/gpu_int8.py --out results/gpu_int8.json
    python benchmarks/gpu_int8.py --config tiny --sequences 64   # smoke test (CPU too)

Each system runs in its own process (the Keras backend is fixed at
import). Inputs: --sequences random full-length token-id rows of
--length tokens, `predict(..., batch_size=--batch)`; the figure is
sequences/s of the fastest of --repeats timed calls after one untimed call
(compilation). Reported with it: which int8 product ran
(`kbert.backend.ops.int8_matmul_path`), how close the int8 logits are to
bf16 (max abs difference, argmax agreement) and peak device memory.
Current figures: benchmarks/RESULTS.md.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

CONFIGS = {
    "base": dict(num_layers=12, num_heads=12, hidden_dim=768, intermediate_dim=3072),
    "tiny": dict(num_layers=2, num_heads=2, hidden_dim=128, intermediate_dim=512),
}
SYSTEMS = ["kbert-jax", "kbert-torch", "kbert-tensorflow", "hf-eager", "hf-compile"]


def token_ids(args):
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(1000, 30000, size=(args.sequences, args.length)).astype("int32")


def timed(fn, repeats):
    fn()  # compilation, warm-up
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def peak_memory():
    try:
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            return stats["peak_bytes_in_use"] / 2**30
    except Exception:  # noqa: BLE001 (the figure is optional; the reason is printed)
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() / 2**30
    except ImportError:
        pass
    return None


def run_kbert(args):
    import keras
    import numpy as np

    import kbert
    from kbert.backend import ops as backend_ops

    keras.config.set_dtype_policy("mixed_bfloat16")
    backbone = kbert.BertBackbone(
        vocabulary_size=30522,
        max_sequence_length=512,
        **CONFIGS[args.config],
        dtype="mixed_bfloat16",
    )
    model = kbert.BertClassifier(backbone, num_classes=2, preprocessor=None)
    ids = token_ids(args)
    x = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": np.ones_like(ids)}

    def predict():
        return np.asarray(model.predict(x, batch_size=args.batch, verbose=0), "float32")

    out = {}
    seconds, reference = timed(predict, args.repeats)
    out["bf16"] = {"sequences_per_s": args.sequences / seconds, "peak_gib": peak_memory()}
    model.quantize("int8")
    dense = model.backbone.get_layer("transformer_layer_0").self_attention.qkv
    sample = np.zeros((2, dense.kernel.shape[0]), "int8")
    seconds, quantized = timed(predict, args.repeats)
    out["int8"] = {
        "sequences_per_s": args.sequences / seconds,
        "peak_gib": peak_memory(),
        "int8_matmul_path": backend_ops.int8_matmul_path(sample, dense.kernel),
        "max_abs_logit_difference": float(np.abs(quantized - reference).max()),
        "argmax_agreement": float((quantized.argmax(-1) == reference.argmax(-1)).mean()),
    }
    out["int8_over_bf16"] = out["int8"]["sequences_per_s"] / out["bf16"]["sequences_per_s"]
    out["backend"] = keras.backend.backend()
    return out


def run_transformers(args, compiled):
    import torch
    import transformers

    config = CONFIGS[args.config]
    hf_config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=config["hidden_dim"],
        num_hidden_layers=config["num_layers"],
        num_attention_heads=config["num_heads"],
        intermediate_size=config["intermediate_dim"],
        num_labels=2,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.BertForSequenceClassification(hf_config).to(device).eval()
    model = model.to(torch.bfloat16)
    if compiled:
        model = torch.compile(model)
    ids = torch.as_tensor(token_ids(args), dtype=torch.long, device=device)

    def predict():
        out = []
        with torch.inference_mode():
            for start in range(0, len(ids), args.batch):
                batch = ids[start : start + args.batch]
                out.append(model(input_ids=batch, attention_mask=torch.ones_like(batch)).logits)
        return torch.cat(out).float().cpu().numpy()

    seconds, _ = timed(predict, args.repeats)
    return {"bf16": {"sequences_per_s": args.sequences / seconds, "peak_gib": peak_memory()}}


def child(args, system):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if system.startswith("kbert-"):
        env["KERAS_BACKEND"] = system[len("kbert-") :]
    command = [sys.executable, __file__, "--child", system]
    for name in ("config", "sequences", "length", "batch", "repeats"):
        command += [f"--{name}", str(getattr(args, name))]
    print(system, file=sys.stderr, flush=True)
    proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not line:
        return {"error": f"exit status {proc.returncode} (its stderr is above)"}
    return json.loads(line[-1][len("RESULT ") :])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="base", choices=sorted(CONFIGS))
    parser.add_argument("--sequences", type=int, default=4096)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS)
    parser.add_argument("--child", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        if args.child.startswith("kbert-"):
            result = run_kbert(args)
        else:
            result = run_transformers(args, compiled=args.child == "hf-compile")
        print("RESULT " + json.dumps(result))
        return
    report = {
        "benchmark": f"BertClassifier predict, {args.config} config, {args.sequences} random "
        f"rows of {args.length} tokens, batch {args.batch}; bf16 vs quantize('int8'); "
        f"fastest of {args.repeats} calls after one untimed call",
        "command": "python benchmarks/gpu_int8.py " + " ".join(sys.argv[1:]),
        "machine": platform.node(),
        "date": time.strftime("%Y-%m-%d"),
        "results": {system: child(args, system) for system in args.systems},
    }
    try:
        import torch

        report["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
