"""torch implementations of the fused operations in `kbert.backend.ops`,
and the torch pieces of clipping and checkpointing.

Why each exists is documented in `kbert.backend.ops`; the measurements are
in `benchmarks/RESULTS.md`.
"""

import contextlib

import keras
import torch
from keras import ops

from kbert.backend import keras_internals


class PackedWeightCache:
    """One oneDNN-reordered weight, valid for one kernel tensor at one version."""

    def __init__(self):
        self.kernel = self.version = self.packed = None

    def get(self, kernel):
        if self.kernel is not kernel or self.version != kernel._version:
            # Holding `kernel` keeps its storage alive, so identity cannot be
            # fooled by a new tensor at a recycled address.
            self.kernel, self.version = kernel, kernel._version
            self.packed = torch.ops.mkldnn._reorder_linear_weight(kernel.t().contiguous(), None)
        return self.packed


def onednn_inference(x):
    """Whether `x` takes oneDNN's packed-weight product: float32 on the CPU,
    without autograd, where torch has the op (torch 2.1-2.13 checked)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and not torch.is_grad_enabled()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def dense(inputs, kernel, bias=None, cache=None):
    """inputs (..., I) @ kernel (I, O) + bias as one GEMM with the bias in
    its epilogue (or oneDNN's packed product for CPU inference)."""
    inputs = ops.convert_to_tensor(inputs)
    kernel = ops.convert_to_tensor(kernel)
    bias = None if bias is None else ops.convert_to_tensor(bias)
    if cache is not None and kernel.dtype == torch.float32 and onednn_inference(inputs):
        return torch.ops.mkldnn._linear_pointwise(inputs, cache.get(kernel), bias, "none", [], "")
    # linear(x, W, b) = x @ W^T + b; W^T of a transposed view is a stride
    # change, not a copy.
    return torch.nn.functional.linear(inputs, kernel.t(), bias)


def _gpu_attention_kernels():
    """The attention kernels torch may pick from on a GPU, as it is set up
    (`torch.backends.cuda.enable_*_sdp`), without cuDNN's; None where cuDNN's
    is already off or is the only one on.

    cuDNN's attention builds a plan for every new input shape, about 0.17 s
    each on an H100 (3.4 s for the first), where FlashAttention and the
    memory-efficient kernel take about 1 ms, and length-bucketed batches
    bring a new shape per bucket; at fine-tuning lengths (16 to 128
    tokens) the memory-efficient kernel also runs a step as fast or faster
    (benchmarks/RESULTS.md). `sdpa_kernel` sets process-wide flags for the
    duration of the call, as torch's own context manager does."""
    from torch.backends import cuda
    from torch.nn.attention import SDPBackend

    if not cuda.cudnn_sdp_enabled():
        return None
    enabled = [
        (cuda.flash_sdp_enabled(), SDPBackend.FLASH_ATTENTION),
        (cuda.mem_efficient_sdp_enabled(), SDPBackend.EFFICIENT_ATTENTION),
        (cuda.math_sdp_enabled(), SDPBackend.MATH),
    ]
    return [backend for on, backend in enabled if on] or None


def sdpa(query, key, value, keep, scale, dropout=0.0):
    """scaled_dot_product_attention on (B, N, T, D) views of (B, T, N, D)
    inputs with a boolean (B, 1, 1, S) mask."""
    q, k, v = (ops.convert_to_tensor(t).transpose(1, 2) for t in (query, key, value))
    kernels = contextlib.nullcontext()
    if q.is_cuda and not torch.compiler.is_compiling():
        backends = _gpu_attention_kernels()
        if backends is not None:
            from torch.nn.attention import sdpa_kernel

            kernels = sdpa_kernel(backends)
    with kernels:
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, scale=scale, dropout_p=float(dropout)
        )  # (B, N, T, D)
    return context.transpose(1, 2)  # (B, T, N, D)


def sublayer_call(layer, *args, **kwargs):
    """`layer.call` under the autocast scope `Layer.__call__` would set,
    for built layers called with eager tensors already in their input dtype;
    `layer(*args, **kwargs)` otherwise."""
    x = args[0]
    if (
        not isinstance(x, torch.Tensor)
        or x.device.type == "meta"
        or keras.backend.standardize_dtype(x.dtype) != layer.input_dtype
    ):
        return layer(*args, **kwargs)
    # The scope Layer.__call__ would enter (keras/src/layers/layer.py).
    current = keras_internals.current_autocast_dtype()
    autocasts = layer.autocast and keras.backend.is_float_dtype(layer.compute_dtype)
    mixed = current is not None or layer.compute_dtype != layer.variable_dtype
    wanted = layer.compute_dtype if autocasts and mixed else None
    if current == wanted:
        return layer.call(*args, **kwargs)
    with keras_internals.autocast_scope(wanted):
        return layer.call(*args, **kwargs)


def global_norm(grads):
    """The float32 global norm of same-dtype gradients with one multi-tensor
    kernel (`torch._foreach_norm`, torch 2.0-2.13 checked), where the
    per-gradient form launches ~4 kernels per variable."""
    norms = torch._foreach_norm(grads, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms))


def scale_all(grads, scale):
    """Every gradient times `scale` in one multi-tensor kernel."""
    return torch._foreach_mul(grads, scale.to(grads[0].dtype))


def rng_state():
    """torch's global generator states (CPU and every GPU) as arrays: Keras'
    torch backend draws unseeded dropout masks from them."""
    state = {"rng_torch_cpu": torch.get_rng_state().numpy()}
    if torch.cuda.is_available():
        for i, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            state[f"rng_torch_cuda_{i}"] = cuda_state.numpy()
    return state


def set_rng_state(arrays):
    """Restores what `rng_state` saved (GPU states only on as many GPUs)."""
    if "rng_torch_cpu" not in arrays:
        return
    torch.set_rng_state(torch.from_numpy(arrays["rng_torch_cpu"].copy()))
    cuda = sorted(k for k in arrays if k.startswith("rng_torch_cuda_"))
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([torch.from_numpy(arrays[k].copy()) for k in cuda])


def fill_padding(x, padding_mask, value):
    """`kbert.backend.ops.fill_padding`: `masked_fill` with the number."""
    x = ops.convert_to_tensor(x)
    return x.masked_fill(ops.convert_to_tensor(padding_mask) == 0, value)
