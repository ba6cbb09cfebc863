"""Speed and memory of long-input encoders on one GPU: kbert's sliding-window
+ global attention (JAX and PyTorch) against transformers' Longformer and
BigBird of the same size, at several lengths, in one call.

    python benchmarks/long_attention_speed.py --output long_attention_speed.json   # a GPU
    python benchmarks/long_attention_speed.py --tiny --output /tmp/s.json          # CPU smoke test

Every engine runs in its own process per length (peak memory is read per
process): a BERT-base size encoder (12 layers, hidden 768, 12 heads) with
random weights and a two-class head, batch `--batch` (2), bf16 compute
(`mixed_bfloat16` in kbert, `torch.autocast` for transformers), window 512
with [CLS] global, attention dropout `--attention-dropout`.
    kbert-jax, kbert-torch  BertClassifier(attention_window=512): whole `predict`
                            (forward) and `fit` (AdamW steps) calls of --steps batches
                            (`--kbert-api batch`: `predict_on_batch`, `train_on_batch`,
                            as the references' loops step); the attention
                            implementation `--attention-implementation` ("auto": on
                            torch with a GPU "torch-flex", elsewhere "banded"), the one
                            that ran reported as attention_path / train_attention_path
    longformer              LongformerForSequenceClassification, attention_window 512
    bigbird                 BigBirdForSequenceClassification, block_sparse, block 64,
                            3 random blocks
Figures: forward and training tokens/s (after `--warmup` untimed steps, the
mean of `--steps` steps, ended by a device sync) and peak device memory in
GiB (also per 1,000 tokens of the batch). Results are printed as JSON lines
and gathered in `--output`.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ENGINES = ("kbert-jax", "kbert-torch", "longformer", "bigbird")
BASE = dict(layers=12, hidden=768, heads=12, intermediate=3072, vocabulary=30522, window=512)
TINY = dict(layers=2, hidden=32, heads=2, intermediate=64, vocabulary=120, window=16)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--attention-dropout", type=float, default=0.0)
    p.add_argument(
        "--attention-implementation",
        default="auto",
        help='kbert engines: "auto", "torch-flex", "banded", ... (the one that ran is reported)',
    )
    p.add_argument("--modes", nargs="+", default=["forward", "train"])
    p.add_argument(
        "--kbert-api",
        default="calls",
        choices=["calls", "batch"],
        help="kbert engines: time whole `predict`/`fit` calls of --steps batches, as users "
        "run them (after one call that compiles), or `predict_on_batch`/`train_on_batch`",
    )
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (smoke test)")
    p.add_argument("--in-process", action="store_true", help="one engine, this process")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    if args.tiny and args.lengths == [4096, 8192, 16384]:
        args.lengths = [128]
    return args


def sizes(args):
    return TINY if args.tiny else BASE


def _inputs(args, length, vocabulary):
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(5, vocabulary, (args.batch, length)).astype("int32")
    ids[:, 0] = 2  # [CLS]
    return ids, np.zeros_like(ids), np.ones_like(ids), np.array([0, 1] * args.batch)[: args.batch]


def _timed(step, sync, args):
    for _ in range(args.warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    return (time.perf_counter() - start) / args.steps


# --- kbert --------------------------------------------------------------------


def measure_kbert(args, length):
    import keras

    import kbert

    s = sizes(args)
    backend = keras.backend.backend()
    if not args.tiny:
        keras.config.set_dtype_policy("mixed_bfloat16")
    backbone = kbert.BertBackbone(
        s["vocabulary"],
        s["layers"],
        s["heads"],
        s["hidden"],
        s["intermediate"],
        max_sequence_length=length,
        attention_dropout=args.attention_dropout,
        attention_window=s["window"],
        attention_implementation=args.attention_implementation,
    )
    model = kbert.BertClassifier(backbone, 2)
    ids, segments, padding, labels = _inputs(args, length, s["vocabulary"])
    x = {"token_ids": ids, "segment_ids": segments, "padding_mask": padding}
    mask = kbert.layers.banded_attention.window_mask(padding, s["window"], 1)
    layer = backbone.transformer_layers[0]
    path, train_path = (
        layer.self_attention.attention_path(
            training, attention_mask=mask, dtype=layer.compute_dtype
        )
        for training in (False, True)
    )
    sync, peak, reset = _device_tools(backend)
    out = {"engine": f"kbert-{backend}", "length": length, "attention_path": path}
    out["train_attention_path"] = train_path
    out["kbert_api"] = args.kbert_api
    if args.kbert_api == "calls":
        forward, train = _whole_calls(args, model, x, labels, sync)
    else:
        forward = lambda: _timed(lambda: model.predict_on_batch(x), sync, args)  # noqa: E731
        train = lambda: _timed(lambda: model.train_on_batch(x, labels), sync, args)  # noqa: E731
    if "forward" in args.modes:
        reset()
        out["forward_tokens_per_s"] = args.batch * length / forward()
        out["forward_peak_gib"] = peak()
        out["forward_cuda_graphs"] = getattr(model, "cuda_graph_stats", None)
    if "train" in args.modes:
        model.compile(learning_rate=1e-5, num_train_steps=1000)
        reset()
        out["train_tokens_per_s"] = args.batch * length / train()
        out["train_peak_gib"] = peak()
    return out


def _whole_calls(args, model, x, labels, sync):
    """(forward, train): each returns seconds per batch of a `predict` /
    `fit` call over `--steps` batches, after a call over `--warmup` batches
    (compilation; on torch a graph per shape is captured within each call)."""

    import numpy as np

    def repeat(n):
        return {k: np.concatenate([v] * n) for k, v in x.items()}, np.concatenate([labels] * n)

    def timed(call):
        call(max(args.warmup, 1))
        sync()
        start = time.perf_counter()
        call(args.steps)
        sync()
        return (time.perf_counter() - start) / args.steps

    def predict(n):
        model.predict(repeat(n)[0], batch_size=args.batch, verbose=0)

    def fit(n):
        data, y = repeat(n)
        model.fit(data, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)

    return (lambda: timed(predict)), (lambda: timed(fit))


def _device_tools(backend):
    """(sync, peak GiB or None, reset peak) for the backend's first device."""
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            return (
                torch.cuda.synchronize,
                lambda: torch.cuda.max_memory_allocated() / 2**30,
                torch.cuda.reset_peak_memory_stats,
            )
        return (lambda: None), (lambda: None), (lambda: None)
    if backend == "jax":
        import jax

        device = jax.devices()[0]

        def sync():
            (jax.device_put(0.0) + 0).block_until_ready()

        def peak():
            stats = device.memory_stats() or {}
            value = stats.get("peak_bytes_in_use")
            return None if value is None else value / 2**30

        # the peak of a JAX process cannot be reset: one process per length,
        # and the training peak includes the forward one
        return sync, peak, (lambda: None)
    return (lambda: None), (lambda: None), (lambda: None)


# --- transformers -----------------------------------------------------------


def measure_transformers(args, length, engine):
    import torch
    import transformers

    s = sizes(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    common = dict(
        vocab_size=s["vocabulary"],
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        intermediate_size=s["intermediate"],
        attention_probs_dropout_prob=args.attention_dropout,
        num_labels=2,
    )
    if engine == "longformer":
        config = transformers.LongformerConfig(
            attention_window=s["window"], max_position_embeddings=length + 2, **common
        )
        model = transformers.LongformerForSequenceClassification(config)
    else:
        block = 64 if not args.tiny else 8
        config = transformers.BigBirdConfig(
            attention_type="block_sparse",
            block_size=block,
            num_random_blocks=3,
            max_position_embeddings=length,
            **common,
        )
        model = transformers.BigBirdForSequenceClassification(config)
    model.to(device)
    ids, segments, padding, labels = _inputs(args, length, s["vocabulary"])
    batch = {
        "input_ids": torch.tensor(ids, dtype=torch.long, device=device),
        "attention_mask": torch.tensor(padding, dtype=torch.long, device=device),
    }
    if engine == "longformer":
        glob = torch.zeros_like(batch["input_ids"])
        glob[:, 0] = 1
        batch["global_attention_mask"] = glob
    targets = torch.tensor(labels, dtype=torch.long, device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=not args.tiny)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    peak = (lambda: torch.cuda.max_memory_allocated() / 2**30) if cuda else (lambda: None)
    out = {"engine": engine, "length": length}
    if "forward" in args.modes:
        model.eval()

        def forward():
            with torch.no_grad(), autocast:
                model(**batch)

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        out["forward_tokens_per_s"] = args.batch * length / _timed(forward, sync, args)
        out["forward_peak_gib"] = peak()
    if "train" in args.modes:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def train():
            with autocast:
                loss = model(**batch, labels=targets).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        out["train_tokens_per_s"] = args.batch * length / _timed(train, sync, args)
        out["train_peak_gib"] = peak()
    return out


def measure(args, engine, length):
    if engine.startswith("kbert"):
        result = measure_kbert(args, length)
    else:
        result = measure_transformers(args, length, engine)
    tokens = args.batch * length / 1000
    for mode in ("forward", "train"):
        if result.get(f"{mode}_peak_gib") is not None:
            result[f"{mode}_gib_per_1k_tokens"] = result[f"{mode}_peak_gib"] / tokens
    return result


def main(argv=None):
    args = parse_args(argv)
    if args.in_process:
        results = [measure(args, engine, n) for engine in args.engines for n in args.lengths]
        for r in results:
            print(json.dumps(r), flush=True)
        return results
    results = []
    for engine in args.engines:
        backend = "jax" if engine == "kbert-jax" else "torch"
        for length in args.lengths:
            command = [sys.executable, os.path.abspath(__file__), "--in-process"]
            command += ["--engines", engine, "--lengths", str(length), "--batch", str(args.batch)]
            command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            command += ["--attention-dropout", str(args.attention_dropout), "--modes", *args.modes]
            command += ["--attention-implementation", args.attention_implementation]
            command += ["--kbert-api", args.kbert_api]
            command += ["--tiny"] if args.tiny else []
            env = dict(os.environ, KERAS_BACKEND=backend)
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not lines:  # out of memory, for one: recorded, not fatal
                result = {"engine": engine, "length": length, "error": done.stderr[-2000:]}
            else:
                result = json.loads(lines[-1])
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "error"}), flush=True)
            if args.output:
                with open(args.output, "w") as f:
                    json.dump({"args": vars(args), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
