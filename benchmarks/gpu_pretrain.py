"""Pre-training step throughput on one GPU: kbert's BertPreTrainer (JAX and
torch backends) vs transformers' BertForPreTraining (eager and
torch.compile), identical shapes, synthetic full-length batches, bf16, AdamW.

    python benchmarks/gpu_pretrain.py                      # every config and system
    python benchmarks/gpu_pretrain.py --configs base128 --variants kbert-jax-drop0 hf-compile
    python benchmarks/gpu_pretrain.py --configs tiny128 --variants kbert-jax-drop0  # smoke test

Each variant runs in its own process (the Keras backend is fixed at import),
one after the other on the same GPU; compare figures within one invocation.
Throughput is steady state for every system: transformers over 2 x --steps
synchronised steps after warm-up; kbert as the difference between a fit of
3 x --steps and one of --steps, which removes fit()'s fixed start-up and
tear-down (the whole-fit figure is reported too). Prints and writes (--out)
sequences/s, model TFLOP/s, MFU against a bf16 8192^3 matrix product timed
in the same run, and peak device memory. `--configs tiny128` (bert_tiny,
batch 8) is a smoke test of the script that also runs on a CPU (best with
JAX variants). Current figures: benchmarks/RESULTS.md.

Variants: `hf-eager`, `hf-compile` (transformers, attention dropout 0.1 as
configured by default), and `kbert-<backend>-drop<attention dropout>`
followed by any of these switches:
    -dp         keras.distribution.DataParallel over every GPU, per-GPU batch unchanged (JAX)
    -dpxla      the same with XLA's attention instead of cuDNN's (JAX)
    -nopad      MLM decoder product on the 30,522 columns, not padded to a multiple of 64 (JAX)
    -cublas     matrix products through cuBLAS only, no Triton GEMMs (JAX)
    -cmdbuf     XLA command buffers (CUDA graphs) for every kind of op and any size (JAX)
    -nocmdbuf   no XLA command buffers (JAX)
    -lhs        XLA's latency-hiding scheduler: gradient all-reduces overlap the backward pass (JAX)
    -nograph    torch: every step eager instead of a CUDA graph replay
    -kerasbatches  torch: batches put on the GPU by Keras' data adapters (blocking copies)
    -jit        torch: Keras' step through torch.compile instead of kbert's step
    -ddp        torch: `torch-ddp` over every GPU under torchrun, per-GPU batch unchanged
    -float8     `model.quantize("float8")`: float8 matrix products with delayed scaling
    -nodrop     no hidden dropout either (an upper bound: what dropout costs)

`hf-eager-ddp` and `hf-compile-ddp` run transformers' model wrapped in
DistributedDataParallel, one process per GPU under torchrun, per-GPU batch
unchanged: what a transformers user launches on several GPUs. A `-ddp` row's
sequences/s counts every GPU's sequences (the global batch).
"""

import argparse
import json
import os
import subprocess
import sys
import time

CONFIGS = {
    # name: (architecture, seq length, batch, predictions per sequence)
    "base128": ("bert_base", 128, 256, 20),
    "base512": ("bert_base", 512, 32, 76),
    "large128": ("bert_large", 128, 128, 20),
    "tiny128": ("bert_tiny", 128, 8, 20),  # a smoke test of the script itself
}
VARIANTS = (
    "kbert-jax-drop0",
    "kbert-jax-drop0.1",
    "kbert-torch-drop0",
    "kbert-torch-drop0.1",
    "hf-eager",
    "hf-compile",
)
VOCAB = 30522


def _is_ddp(variant):
    return variant.endswith("-ddp") or "-ddp-" in variant


def _multi_gpu(variant):
    return _is_ddp(variant) or "-dp" in variant


def train_flops_per_sequence(arch, t, p):
    """Matmul FLOPs of one training step per sequence (forward x 3)."""
    import importlib

    sizes = importlib.import_module("kbert.presets.architectures").ARCHITECTURES[arch]
    layers, h, i = sizes["num_layers"], sizes["hidden_dim"], sizes["intermediate_dim"]
    encoder = t * 2 * layers * (4 * h * h + 2 * h * i) + layers * 4 * t * t * h
    heads = p * 2 * (h * h + h * VOCAB) + 2 * 2 * h * h
    return 3 * (encoder + heads)


def batch(t, b, p, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = {
        "token_ids": rng.integers(5, VOCAB, (b, t)).astype("int32"),
        "segment_ids": (np.arange(t)[None] >= t // 2).repeat(b, 0).astype("int32"),
        "padding_mask": np.ones((b, t), "int32"),
        "mask_positions": np.sort(rng.integers(1, t - 1, (b, p)), axis=1).astype("int32"),
    }
    y = {
        "mask_ids": rng.integers(5, VOCAB, (b, p)).astype("int32"),
        "mask_weights": np.ones((b, p), "float32"),
        "next_sentence_labels": rng.integers(0, 2, (b,)).astype("int32"),
    }
    return x, y


def check_fused_attention():
    """On the GPU: the fused path equals the explicit one on a padded batch."""
    import keras
    import numpy as np

    import kbert

    backbone = kbert.BertBackbone(
        1000, 2, 4, 64, 128, max_sequence_length=64, dropout=0.0, attention_dropout=0.0
    )
    rng = np.random.default_rng(0)
    mask = (np.arange(48)[None] < rng.integers(1, 49, (8, 1))).astype("int32")
    mask[3] = 0  # an all-padding row
    x = {
        "token_ids": rng.integers(0, 1000, (8, 48)).astype("int32") * mask,
        "segment_ids": np.zeros((8, 48), "int32"),
        "padding_mask": mask,
    }
    fused = keras.ops.convert_to_numpy(backbone(x)["sequence_output"])
    layer = backbone.transformer_layers[0].self_attention
    if hasattr(layer, "attention_implementation"):
        reference = kbert.BertBackbone.from_config(
            {**backbone.get_config(), "attention_implementation": "explicit"}
        )
        reference.set_weights(backbone.get_weights())
        explicit = keras.ops.convert_to_numpy(reference(x)["sequence_output"])
    else:  # a tree from before the attention table (gpu_compare's baselines)
        cls = type(layer)
        original = cls.attention_path
        cls.attention_path = lambda self, training=None: "explicit"
        explicit = keras.ops.convert_to_numpy(backbone(x)["sequence_output"])
        cls.attention_path = original
    real = mask.astype(bool)
    real[3] = False
    error = float(np.abs(fused - explicit)[real].max())
    return {
        "fused_vs_explicit_max_abs": error,
        "finite": bool(np.isfinite(fused).all()),
        "path": layer.attention_path(False),
    }


def run_kbert(arch, t, b, p, variant, steps, spe, data=None):
    import keras
    import numpy as np

    import kbert

    options = variant.split("-")[2:]
    dropout = float(options[0][len("drop") :])
    if "ddp" in options:  # one process per GPU, launched by torchrun
        from kbert.training import distribution_scope

        _, processes = distribution_scope("torch-ddp")
        b *= processes
    if keras.backend.backend() == "torch":
        spe = 1  # Keras' torch trainer runs one step per call
        if "kerasbatches" in options:  # Keras' own blocking batch copies
            import contextlib

            import kbert.backend.torch_step as torch_step

            torch_step.host_batches = lambda force=False: contextlib.nullcontext()
    if "nopad" in options:  # the MLM decoder product on the unpadded vocabulary
        kbert.layers.TokenEmbedding.REVERSE_PAD = 0
    if "dpxla" in options:  # the XLA attention path under the distribution
        import kbert.backend.jax_ops as jax_ops

        jax_ops.on_gpu = lambda: False
    if (
        "dp" in options or "dpxla" in options
    ):  # data parallel over every local GPU, same per-GPU batch
        devices = keras.distribution.list_devices("gpu")
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
        b *= len(devices)
    keras.config.set_dtype_policy("mixed_bfloat16")
    backbone = kbert.BertBackbone.from_architecture(
        arch,
        max_sequence_length=512,
        attention_dropout=dropout,
        dtype="mixed_bfloat16",
        dropout=0.0 if "nodrop" in options else 0.1,
    )
    model = kbert.BertPreTrainer(backbone)
    if "float8" in options:
        model.quantize("float8")
    # torch: kbert's own step (a CUDA graph on a GPU); -jit hands Keras' step
    # to torch.compile instead.
    model.compile(
        optimizer=kbert.training.create_optimizer(1e-4, 10_000, 100),
        steps_per_execution=spe,
        jit_compile=keras.backend.backend() != "torch" or "jit" in options,
        cuda_graph="nograph" not in options,
    )
    # Steady state, as the transformers loop is timed (synchronised before
    # and after, no start-up): fit() has a fixed cost per call (iterator,
    # callbacks, the final sync, writing the state back to the Keras
    # variables), so time a short and a long fit and divide the difference
    # in time by the difference in steps. Whole-fit figures are kept too.
    long = 3 * steps
    if data:  # real batches, each fit taking the next rows (wrapping round)
        from kbert.data.numpy_io import X_NAMES, Y_NAMES

        arrays = {n: np.load(os.path.join(data, f"{n}.npy")) for n in X_NAMES + Y_NAMES}
        total = (2 * spe + steps + long) * b
        rows = np.arange(total) % len(arrays["token_ids"])
        xs = {
            n: arrays[n][rows][:, :t] if n != "mask_positions" else arrays[n][rows] for n in X_NAMES
        }
        ys = {n: arrays[n][rows] for n in Y_NAMES}
    else:  # one synthetic batch, repeated
        x, y = batch(t, b, p)
        xs = {k: np.concatenate([v] * long) for k, v in x.items()}
        ys = {k: np.concatenate([v] * long) for k, v in y.items()}
    curve, offset = [], [0]

    class Curve(keras.callbacks.Callback):
        """The logged loss (the running mean of the fit's steps) after each
        execution, with the optimizer step it was logged at."""

        def on_train_batch_end(self, batch_index, logs=None):
            step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
            curve.append((step, float(logs["loss"])))

    def fit(n):
        begin = offset[0] * b if data else 0
        offset[0] += n
        start = time.perf_counter()
        history = model.fit(
            {k: v[begin : begin + n * b] for k, v in xs.items()},
            {k: v[begin : begin + n * b] for k, v in ys.items()},
            batch_size=b,
            epochs=1,
            verbose=0,
            shuffle=False,
            callbacks=[Curve()] if data else None,
        ).history
        return time.perf_counter() - start, float(history["loss"][-1])

    first_s, _ = fit(2 * spe)  # compile and warm up
    short_s, _ = fit(steps)
    long_s, loss = fit(long)
    n = (long - steps) * b
    seconds = long_s - short_s
    peak = None
    if keras.backend.backend() == "jax":
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        peak = stats.get("peak_bytes_in_use")
    else:
        import torch

        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    if "ddp" in options:
        import torch.distributed as dist

        if dist.get_rank() != 0:
            return None
    result = {
        "seconds": seconds,
        "sequences": n,
        "loss": loss,
        "peak_bytes": peak,
        "whole_fit": {"steps": long, "seconds": long_s, "seq_per_s": long * b / long_s},
        "first_fit_seconds": first_s,  # compilation and the first 2 executions
        "attention_path": backbone.transformer_layers[0].self_attention.attention_path(True),
        "fused_kernel": attention_kernel(xs, ys, b, kbert_step="jit" not in options),
    }
    if data:
        result["loss_curve"] = curve
    if getattr(model, "cuda_graph_stats", None):
        result["cuda_graph"] = model.cuda_graph_stats
    if keras.backend.backend() == "jax":
        result["check"] = check_fused_attention()
    return result


def attention_kernel(xs, ys, b, kbert_step):
    """The attention kernel the training steps ran: on torch, kbert's step
    (`kbert_step`, not torch.compile) runs attention over segments where
    `torch_step.segments_apply` takes the first batch."""
    import keras

    import kbert

    layer = kbert.layers.MultiHeadSelfAttention(2, 8, dtype="mixed_bfloat16")
    kernel = layer.attention_path(False)
    if kernel == "fused":  # a tree from before the attention table
        kernel = kbert.backend.ops.fused_attention_path()
    if keras.backend.backend() == "torch" and kbert_step:
        from kbert.backend import torch_step

        first = ({k: v[:b] for k, v in xs.items()}, {k: v[:b] for k, v in ys.items()})
        applies = getattr(torch_step, "segments_apply", None)  # absent from older trees
        if applies is not None and applies(first):
            kernel = "torch-flash-segments"
    return kernel


def hf_train_step(arch, t, b, p, ddp=False):
    """transformers BertForPreTraining on the GPU: one AdamW training step
    (bf16 autocast, clipping 1.0) on the synthetic batch, as a function.
    With `ddp`, the model is wrapped in DistributedDataParallel (one process
    per GPU, under torchrun) and each process trains on its own batch."""
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rank = 0
    if ddp:
        import torch.distributed as dist

        if device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        rank = dist.get_rank()

    import kbert.presets.architectures as a

    sizes = a.ARCHITECTURES[arch]
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=sizes["hidden_dim"],
        num_hidden_layers=sizes["num_layers"],
        num_attention_heads=sizes["num_heads"],
        intermediate_size=sizes["intermediate_dim"],
        attn_implementation="sdpa",
    )
    model = transformers.BertForPreTraining(config).to(device).train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, weight_decay=0.01, fused=device == "cuda"
    )
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    x, y = batch(t, b, p, seed=rank)
    labels = torch.full((b, t), -100, dtype=torch.long)
    pos = torch.tensor(x["mask_positions"]).long()
    labels.scatter_(1, pos, torch.tensor(y["mask_ids"]).long())
    inputs = {
        "input_ids": torch.tensor(x["token_ids"]).long(),
        "token_type_ids": torch.tensor(x["segment_ids"]).long(),
        "attention_mask": torch.tensor(x["padding_mask"]).long(),
        "labels": labels,
        "next_sentence_label": torch.tensor(y["next_sentence_labels"]).long(),
    }
    inputs = {k: v.to(device) for k, v in inputs.items()}

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def run_hf(arch, t, b, p, compile_, steps, ddp=False):
    import torch

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else lambda: None
    step = hf_train_step(arch, t, b, p, ddp)
    if compile_:
        step = torch.compile(step)
    for _ in range(3):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    processes = 1
    if ddp:
        import torch.distributed as dist

        dist.barrier()
        processes = dist.get_world_size()
    steps *= 2  # as many steps as kbert's timed window
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    seconds = time.perf_counter() - start
    if ddp and dist.get_rank() != 0:
        return None
    return {
        "seconds": seconds,
        "sequences": steps * b * processes,
        "loss": float(loss),
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }


def matmul_tflops():
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 20 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12


def child(args):
    arch, t, b, p = CONFIGS[args.config]
    v = args.variant
    if v.startswith("kbert"):
        result = run_kbert(arch, t, b, p, v, args.steps, args.steps_per_execution, args.data)
    else:
        result = run_hf(arch, t, b, p, "compile" in v, args.steps, v.endswith("-ddp"))
    if result is not None:  # under DDP, process 0 reports
        print("RESULT " + json.dumps(result), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", default=["base128", "base512", "large128"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--steps-per-execution", type=int, default=10)
    parser.add_argument("--out", default="gpu_pretrain.json")
    parser.add_argument("--timeout", type=int, default=240)
    parser.add_argument(
        "--data",
        default=None,
        help="kbert variants: real batches from an export_numpy directory (made with "
        "`kbert create-pretraining-data` then kbert.data.export_numpy) instead of one "
        "synthetic batch; records the loss after every execution (loss_curve)",
    )
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--config")
    parser.add_argument("--variant")
    args = parser.parse_args()
    if args.child:
        return child(args)

    # This process imports kbert only for the architecture sizes; each
    # variant's process sets its own backend.
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import torch

    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
        peak = matmul_tflops()
        print(f"{device}: bf16 8192^3 matmul {peak:.0f} TFLOP/s", flush=True)
    else:  # the tiny128 smoke test: no MFU
        device, peak = "cpu", None
    report = {"device": device, "matmul_tflops": peak, "results": []}
    for config in args.configs:
        arch, t, b, p = CONFIGS[config]
        flops = train_flops_per_sequence(arch, t, p)
        for variant in args.variants:
            env = dict(os.environ)
            # transformers' variants import kbert only for the architecture sizes
            env["KERAS_BACKEND"] = variant.split("-")[1] if variant.startswith("kbert") else "torch"
            if variant.endswith("-cublas"):  # matrix products through cuBLAS only
                env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false"
            if variant.endswith("-cmdbuf"):
                env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + (
                    " --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
                    " --xla_gpu_graph_min_graph_size=1"
                )
            if variant.endswith("-lhs"):  # collectives scheduled to overlap with compute
                env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + (
                    " --xla_gpu_enable_latency_hiding_scheduler=true"
                )
            if variant.endswith("-nocmdbuf"):
                env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
            steps = args.steps
            launcher = [sys.executable]
            if _is_ddp(variant):
                gpus = torch.cuda.device_count() or 2  # two CPU processes for a smoke test
                launcher += ["-m", "torch.distributed.run", "--standalone"]
                launcher += ["--nproc_per_node", str(gpus)]
            cmd = [
                *launcher,
                __file__,
                "--child",
                "--config",
                config,
                "--variant",
                variant,
                "--steps",
                str(steps),
                "--steps-per-execution",
                str(args.steps_per_execution),
            ]
            if args.data:
                cmd += ["--data", args.data]
            started = time.time()
            try:
                proc = subprocess.run(
                    cmd, env=env, capture_output=True, text=True, timeout=args.timeout
                )
                lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
                if not lines:
                    with open(f"{args.out}.{config}.{variant}.stderr", "w") as f:
                        f.write(proc.stderr)
                    raise RuntimeError((proc.stderr or proc.stdout)[-1500:])
                r = json.loads(lines[-1][7:])
                sps = r["sequences"] / r["seconds"]
                # multi-GPU rows: the model FLOPs of all GPUs against all GPUs' peak
                devices = max(torch.cuda.device_count(), 1) if _multi_gpu(variant) else 1
                r.update(
                    config=config,
                    variant=variant,
                    devices=devices,
                    seq_per_s=sps,
                    tflops=sps * flops / 1e12,
                    mfu=sps * flops / 1e12 / peak / devices if peak else None,
                    wall_s=time.time() - started,
                )
                print(
                    f"{config:9s} {variant:24s} {sps:9.0f} seq/s {r['tflops']:6.0f} TFLOP/s "
                    f"MFU {r['mfu'] or 0:.2f} "
                    f"peak {((r['peak_bytes'] or 0) / 2**30):.1f} GiB loss {r['loss']:.2f}",
                    flush=True,
                )
            except Exception as e:  # report and go on: one failing variant must not lose the others
                r = {"config": config, "variant": variant, "error": str(e)[-1500:]}
                print(f"{config:9s} {variant:20s} FAILED: {str(e)[-600:]}", flush=True)
            report["results"].append(r)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
