"""torch on a GPU: one attention layer's forward and backward, the masked
memory-efficient kernel against kbert's segment attention.

    KERAS_BACKEND=torch python benchmarks/attention_kernels.py --out attention.json
    KERAS_BACKEND=torch python benchmarks/attention_kernels.py \\
        --xquad-lengths ../shared/data --vocab path/to/vocab.txt --out attention.json

Batch 32, 12 heads of 64, bfloat16, attention dropout 0.1, rows padded on
the right. GPU time: ten forward and backward passes captured as one CUDA
graph (as `fit` replays its step), replayed `--replays` times. "masked" is
`scaled_dot_product_attention` with a boolean (B, 1, 1, S) mask on the
memory-efficient kernel (what the training step runs below
`torch_ops.SEGMENT_MIN_LENGTH` tokens and where the padding does not
trail); "segments" is `torch_ops._segment_sdpa` (FlashAttention over each
row's real tokens, and its padding in chunks). Real lengths are drawn
uniformly from a quarter of the row to all of it, row 0 full; with
`--xquad-lengths DATA_DIR`, the 384-token rows take the lengths of the
XQuAD training windows as `BertQuestionAnswerer` makes them (question and
context, stride 128). `check` compares the two at real tokens, dropout 0.
Figures: benchmarks/RESULTS.md.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BATCH, HEADS, DEPTH = 32, 12, 64


def xquad_lengths(data_dir, vocab):
    import gpu_finetune
    import numpy as np

    import kbert

    texts, _ = gpu_finetune.load("xquad", data_dir, None)
    preprocessor = kbert.BertPreprocessor(kbert.BertTokenizer(vocab, lowercase=True), 384)
    backbone = kbert.BertBackbone.from_architecture("bert_tiny", vocabulary_size=30522)
    model = kbert.BertQuestionAnswerer(backbone, preprocessor=preprocessor)
    return np.asarray(model.prepare_features(*texts).x["padding_mask"]).sum(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 144, 192, 256, 384])
    parser.add_argument("--xquad-lengths", metavar="DATA_DIR")
    parser.add_argument("--vocab")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kbert.backend import torch_ops

    if keras.backend.backend() != "torch" or not torch.cuda.is_available():
        sys.exit("attention_kernels.py measures the torch backend on a GPU")
    windows = xquad_lengths(args.xquad_lengths, args.vocab) if args.xquad_lengths else None
    scale = DEPTH**-0.5

    def masked(q, k, v, mask, dropout):
        keep = mask.bool()[:, None, None, :]
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            heads_first = (t.transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(
                *heads_first, attn_mask=keep, dropout_p=dropout, scale=scale
            )
        return out.transpose(1, 2)

    def segments(q, k, v, mask, dropout):
        return torch_ops._segment_sdpa(q, k, v, mask, scale, dropout)

    def inputs(length, seed):
        rng = np.random.default_rng(seed)
        if length == 384 and windows is not None:
            real = rng.choice(windows, BATCH)
        else:
            real = rng.integers(length // 4, length + 1, BATCH)
        real[0] = length
        mask = torch.as_tensor(np.arange(length)[None] < real[:, None], device="cuda")
        q, k, v = (
            torch.randn(
                BATCH, length, HEADS, DEPTH, device="cuda", dtype=torch.bfloat16
            ).requires_grad_()
            for _ in range(3)
        )
        return q, k, v, mask.int(), float(real.mean())

    def gpu_ms(fn, length):
        q, k, v, mask, mean = inputs(length, 0)
        grad = torch.randn_like(q)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn(q, k, v, mask, 0.1).backward(grad)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                fn(q, k, v, mask, 0.1).backward(grad)
        graph.replay()
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(args.replays):
            graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - begin) / args.replays / 10 * 1e3, mean

    def check(length):
        q, k, v, mask, _ = inputs(length, 1)
        real = mask[:, :, None, None].float()
        grad = torch.randn_like(q) * real
        outs = [fn(q, k, v, mask, 0.0) for fn in (masked, segments)]
        grads = [torch.autograd.grad(o, (q, k, v), grad) for o in outs]
        return {
            "output_max_error": float(((outs[0] - outs[1]).float().abs() * real).max()),
            "grad_max_error": max(float((a - b).float().abs().max()) for a, b in zip(*grads)),
            "grad_max": max(float(g.float().abs().max()) for g in grads[0]),
        }

    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "shape": {"batch": BATCH, "heads": HEADS, "head_dim": DEPTH, "dtype": "bfloat16"},
        "attention_dropout": 0.1,
        "xquad_windows": windows is not None,
        "segment_chunk": torch_ops.SEGMENT_CHUNK,
        "rows": {},
    }
    for length in args.lengths:
        masked_ms, mean = gpu_ms(masked, length)
        segments_ms, _ = gpu_ms(segments, length)
        row = {
            "mean_real_tokens": round(mean, 1),
            "masked_ms": round(masked_ms, 4),
            "segments_ms": round(segments_ms, 4),
            "check": check(length),
        }
        result["rows"][length] = row
        print(length, json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
