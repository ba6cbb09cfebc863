"""torch implementations of the fused operations in `kbert.backend.ops`,
and the torch pieces of clipping and checkpointing.

Why each exists is documented in `kbert.backend.ops`; the measurements are
in `benchmarks/RESULTS.md`.
"""

import contextlib
import threading
import weakref

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


_PLAIN = threading.local()


@contextlib.contextmanager
def plain_dense():
    """Inside the block, the forward a TorchScript trace records
    (`kbert.backend.torch_trace`): dense layers through
    `torch.nn.functional.linear` (the tracer cannot record oneDNN's packed
    product) on the padded batch (no `token_packing`), so that the eager
    and the traced forward of a batch give the same bits."""
    before = getattr(_PLAIN, "on", False)
    _PLAIN.on = True
    try:
        yield
    finally:
        _PLAIN.on = before


def onednn_inference(x):
    """Whether `x` takes oneDNN's packed-weight product: float32 on the CPU,
    without autograd, outside `torch.compile` (whose Inductor cannot lower
    the product on a weight packed outside its graph; it packs weights
    itself) and TorchScript traces (`plain_dense`), where torch has the op
    (torch 2.1-2.13 checked)."""
    return (
        not getattr(_PLAIN, "on", False)
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
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


def _int_mm_shape_ok(x2, kernel):
    """cuBLASLt's int8 product takes I and O multiples of 8 (rows are padded
    by `int8_matmul`); oneDNN's takes any shape."""
    if x2.device.type != "cuda":
        return True
    return x2.shape[-1] % 8 == 0 and kernel.shape[-1] % 8 == 0


def int8_matmul_path(inputs, kernel):
    x2 = inputs.reshape(-1, inputs.shape[-1])
    return "torch-int-mm" if _int_mm_shape_ok(x2, kernel) else "torch-matmul-int32"


def int8_quantize_rows(inputs, value_range, epsilon):
    """Keras' `abs_max_quantize(inputs, axis=-1)` in torch operations with
    the Python numbers as kernel arguments: Keras' version turns them into
    device tensors, a host-to-device copy that CUDA-graph capture refuses."""
    inputs = ops.convert_to_tensor(inputs)
    low, high = value_range
    if inputs.device.type == "cpu" and not torch.is_grad_enabled() and -low == high <= 127:
        return _int8_quantize_rows_cpu(inputs, high, epsilon)
    denominator = inputs.abs().amax(dim=-1, keepdim=True) + epsilon
    # a true division, as Keras' (scalar / tensor is a reciprocal times the scalar)
    scale = torch.full_like(denominator, high) / denominator
    return torch.clamp(torch.round(inputs * scale), low, high).to(torch.int8), scale


def _int8_quantize_rows_cpu(inputs, high, epsilon):
    """`int8_quantize_rows` for CPU inference in fewer passes over the
    inputs than the general form (each a parallel region of torch's thread
    pool): the rounding in place and no clamp. The clamp is left out:
    |x| <= max|x| makes |x * high / (max|x| + eps)| at most `high` to a
    rounding of the float product, which rounds to `high`, so the integers
    are those of the general form. The row maxima are `abs().amax()`: the
    infinity norm (`linalg.vector_norm`, one pass) gives the same maxima
    but runs several times slower on a CPU."""
    denominator = inputs.abs().amax(dim=-1, keepdim=True) + epsilon
    scale = torch.full_like(denominator, high) / denominator
    scaled = inputs * scale
    return scaled.round_().to(torch.int8), scale


def int8_dequantize(product, kernel_scale, inputs_scale, bias, dtype):
    """Keras' int8 `Dense` rescaling, product (..., O) int32 ->
    product / (kernel_scale * inputs_scale) + bias in `dtype`: on the CPU
    without autograd the division and the bias add are one pass
    (`addcdiv`, whose factor 1 is exact) into the cast product, in place;
    None elsewhere, and for operands other than float32 (the caller runs
    Keras' operations, whose type promotion decides the result)."""
    product = ops.convert_to_tensor(product)
    if product.device.type != "cpu" or torch.is_grad_enabled() or dtype != torch.float32:
        return None
    operands = [ops.convert_to_tensor(kernel_scale), ops.convert_to_tensor(inputs_scale)]
    if bias is not None:
        operands.append(ops.convert_to_tensor(bias))
    if any(t.dtype != torch.float32 for t in operands):
        return None  # Keras' type promotion decides the result's dtype
    x = product.to(torch.float32)
    denominator = operands[0] * operands[1]
    if denominator.shape != x.shape:
        return None
    if bias is None:
        return x.div_(denominator)
    return torch.addcdiv(operands[2], x, denominator, out=x)


def int8_matmul(inputs, kernel):
    """inputs (..., I) int8 @ kernel (I, O) int8 -> (..., O) int32."""
    inputs = ops.convert_to_tensor(inputs)
    kernel = ops.convert_to_tensor(kernel)
    lead = inputs.shape[:-1]
    x2 = inputs.reshape(-1, inputs.shape[-1])
    if not _int_mm_shape_ok(x2, kernel):
        return torch.matmul(inputs.to(torch.int32), kernel.to(torch.int32))
    rows = x2.shape[0]
    if x2.device.type == "cuda" and (rows <= 16 or rows % 8):
        # cuBLASLt's int8 product takes more than 16 rows, a multiple of 8
        x2 = torch.nn.functional.pad(x2, (0, 0, 0, max(24, -(-rows // 8) * 8) - rows))
    out = torch._int_mm(x2, kernel)
    return out[:rows].reshape(*lead, kernel.shape[-1])


def _gpu_attention_kernels():
    """The attention kernels torch may pick from on a GPU, as it is set up
    (`torch.backends.cuda.enable_*_sdp`), without cuDNN's; None where cuDNN's
    is already off or is the only one on.

    cuDNN's attention builds a plan for every new input shape, far slower
    than FlashAttention's or the memory-efficient kernel's start, and
    length-bucketed batches bring a new shape per bucket; at fine-tuning
    lengths (16 to 128 tokens) the memory-efficient kernel also runs a
    step as fast or faster. `sdpa_kernel` sets process-wide flags for the
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


# Segment attention (`segment_attention`): from this many tokens per row
# (below it the memory-efficient kernel with a mask is as fast or faster),
# padding split into segments of at most `SEGMENT_CHUNK` tokens. The
# crossover is measured by benchmarks/attention_kernels.py (figures in
# benchmarks/RESULTS.md, "Attention over segments").
SEGMENT_MIN_LENGTH = 144
SEGMENT_CHUNK = 128

_SEGMENTS = threading.local()


@contextlib.contextmanager
def segment_attention(on=True):
    """Within the block (a training step whose padding trails each row's
    real tokens and whose losses read no padding output:
    `torch_step.segments_apply`), self-attention over a
    (B, T) padding mask on a GPU runs as FlashAttention over variable-length
    segments: each row's real tokens attend to each other, exactly as with
    the mask, and its padding tokens to each other, in segments of at most
    `SEGMENT_CHUNK` tokens, instead of to the row's real tokens. Padding
    outputs reach no loss (the caller checks that targets given per token
    are weighted 0 at padding), so the step's losses and gradients are
    those of the masked attention; the kernel skips the products of real
    tokens with padding. Only where the mask has each row's real tokens
    first: the caller checks that too."""
    previous = getattr(_SEGMENTS, "on", False)
    _SEGMENTS.on = bool(on)
    try:
        yield
    finally:
        _SEGMENTS.on = previous


def _segment_bounds(padding_mask, length):
    """(B, T) padding mask with its real tokens first -> cumulative segment
    bounds (B * (1 + ceil(T / SEGMENT_CHUNK)) + 1,) int32: each row's real
    tokens, then its padding in chunks (empty segments where there is less).
    A row without real tokens is one segment, as the masked attention lets
    it attend to every key (`ops.attention_keep`)."""
    real = (padding_mask != 0).sum(1, dtype=torch.int32)
    real = torch.where(real == 0, length, real)
    chunks = torch.arange(
        -(-length // SEGMENT_CHUNK), device=padding_mask.device, dtype=torch.int32
    )
    padding = ((length - real)[:, None] - SEGMENT_CHUNK * chunks[None]).clamp(0, SEGMENT_CHUNK)
    sizes = torch.cat([real[:, None], padding], 1).reshape(-1)
    return torch.nn.functional.pad(sizes.cumsum(0, dtype=torch.int32), (1, 0))


def _segments_apply(q, k, padding_mask):
    if not getattr(_SEGMENTS, "on", False) or padding_mask is None:
        return False
    if len(padding_mask.shape) != 2 or not q.is_cuda or torch.compiler.is_compiling():
        return False
    batch, length, _, depth = q.shape
    return (
        length >= SEGMENT_MIN_LENGTH
        and tuple(k.shape[:2]) == (batch, length)
        and tuple(padding_mask.shape) == (batch, length)
        and q.dtype in (torch.bfloat16, torch.float16)
        and depth % 8 == 0
        and depth <= 128  # larger heads' backward needs an sm80/sm90 GPU
        and torch.backends.cuda.flash_sdp_enabled()
        and torch.cuda.get_device_capability(q.device) >= (8, 0)
        and hasattr(torch.ops.aten, "_flash_attention_forward")
    )


def _segment_sdpa(q, k, v, padding_mask, scale, dropout):
    """(B, T, N, D) -> (B, T, N, D) under `segment_attention`."""
    batch, length, heads, depth = q.shape
    bounds = _segment_bounds(padding_mask, length)
    flat = [t.reshape(batch * length, heads, depth) for t in (q, k, v)]
    context = torch.ops.aten._flash_attention_forward(
        *flat, bounds, bounds, length, length, float(dropout), False, False, scale=scale
    )[0]
    return context.reshape(batch, length, heads, depth)


_MASKS = threading.local()


@contextlib.contextmanager
def shared_masks():
    """Within the block, the masks attention derives from one padding mask
    (the boolean keep mask, the additive bias `sdpa` passes to torch) are
    made once and shared by every layer that reads that mask tensor, e.g.
    the blocks of one decoding step: each layer made its own, six small
    kernels per layer and token. Masks are matched by tensor identity and
    in-place version."""
    previous = getattr(_MASKS, "table", None)
    _MASKS.table = {}
    try:
        yield
    finally:
        _MASKS.table = previous


def shared_mask(kind, tensor, make):
    """`make()`, or within `shared_masks` the value made for this `kind` of
    this tensor (unchanged since) earlier in the block."""
    table = getattr(_MASKS, "table", None)
    if table is None or not isinstance(tensor, torch.Tensor):
        return make()
    key = (kind, id(tensor))
    entry = table.get(key)
    if entry is None or entry[0] is not tensor or entry[1] != tensor._version:
        entry = table[key] = (tensor, tensor._version, make())
    return entry[2]


def _additive_bias(keep, dtype):
    """The boolean keep mask as the additive bias torch makes of it (0 or
    -inf in the inputs' dtype), its rows padded to a multiple of 16 keys so
    that the memory-efficient kernel takes it without a copy."""
    length = keep.shape[-1]
    padded = -(-length // 16) * 16
    bias = torch.zeros((*keep.shape[:-1], padded), dtype=dtype, device=keep.device)
    bias[..., :length].masked_fill_(~keep, float("-inf"))
    return bias[..., :length]


def sdpa(query, key, value, keep, scale, dropout=0.0, padding_mask=None):
    """scaled_dot_product_attention on (B, N, T, D) views of (B, T, N, D)
    inputs with a boolean (B, 1, 1, S) or (B, 1, T, S) mask; under
    `segment_attention`, given the (B, T) `padding_mask`, FlashAttention
    over segments."""
    query, key, value = (ops.convert_to_tensor(t) for t in (query, key, value))
    if _segments_apply(query, key, padding_mask):
        mask = ops.convert_to_tensor(padding_mask)
        return _segment_sdpa(query, key, value, mask, scale, dropout)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if getattr(_MASKS, "table", None) is not None and keep is not None and keep.dtype == torch.bool:
        keep = shared_mask(("bias", q.dtype), keep, lambda: _additive_bias(keep, q.dtype))
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


# Pack a batch when at least this share of its tokens is padding: below it
# the gathers and scatters cost about what the skipped rows would.
PACK_MIN_PADDING = 0.125
# Attention groups: a group of b rows padded to T costs about b * T^2 plus
# this much for its own calls (in the same units; calibrated on a 2-core
# CPU at 12 heads of 32, forward and backward).
GROUP_COST = 700


class AttentionGroup:
    """Some rows of a packed batch, each with its real tokens first, as a
    (b, T_g) batch: `rows` (n_g,) are the packed tokens it holds, `slots`
    where they go in its (b * T_g) rows, `padding_mask` (b, T_g)."""

    def __init__(self, rows, slots, padding_mask):
        self.rows, self.slots, self.padding_mask = rows, slots, padding_mask

    def scatter(self, tokens):
        """(n, C) packed tokens -> (b, T_g, C), zeros at the padding."""
        batch, length = self.padding_mask.shape
        out = tokens.new_zeros(batch * length, tokens.shape[-1])
        out = out.index_copy(0, self.slots, tokens.index_select(0, self.rows))
        return out.reshape(batch, length, tokens.shape[-1])

    def gather(self, x):
        """(b, T_g, C) -> (n_g, C): the rows of this group's real tokens."""
        return x.reshape(-1, x.shape[-1]).index_select(0, self.slots)


class TokenPacking:
    """The real tokens of a (B, T) batch as one (n, C) matrix and back, and
    its rows in groups of similar length for attention.

    `index` holds the flat positions b * T + t of the n real tokens."""

    def __init__(self, keep):
        self.batch, self.length = keep.shape
        self.index = keep.reshape(-1).nonzero().squeeze(1)
        self._keep = keep
        self._groups = None

    def gather(self, x):
        """(B, T, C) -> (n, C): the rows of the real tokens."""
        x = ops.convert_to_tensor(x)
        return x.reshape(self.batch * self.length, x.shape[-1]).index_select(0, self.index)

    def scatter(self, x, base=None):
        """(n, C) -> (B, T, C): the rows of `base` (B, T, C) with its real
        tokens' rows replaced by `x`; without `base`, zeros elsewhere."""
        x = ops.convert_to_tensor(x)
        if base is None:
            rows = x.new_zeros(self.batch * self.length, x.shape[-1])
        else:
            rows = ops.convert_to_tensor(base).reshape(self.batch * self.length, x.shape[-1])
        return rows.index_copy(0, self.index, x).reshape(self.batch, self.length, x.shape[-1])

    def attention_groups(self):
        """`AttentionGroup`s that together hold every real token once.

        Attention is over the real keys of each row only, so a row's tokens
        may move to the front of a shorter row; rows sorted by length and
        cut into groups of equal size pad each group to its own longest,
        and the attention work (b * T^2 per group) falls with the padding.
        The group count (1, 2, 4, ...) is the cheapest under GROUP_COST."""
        if self._groups is not None:
            return self._groups
        keep = self._keep
        lengths = keep.sum(1)
        order = torch.argsort(lengths, stable=True)
        ordered = lengths[order].tolist()
        batch = len(ordered)

        def cuts(count):
            size = -(-batch // count)
            return [(s, min(s + size, batch)) for s in range(0, batch, size)]

        def cost(bounds):
            return sum((e - s) * max(ordered[e - 1], 1) ** 2 + GROUP_COST for s, e in bounds)

        counts = [c for c in (1, 2, 4, 8, 16, 32) if c <= batch]
        bounds = min((cuts(c) for c in counts), key=cost)
        # For each real token (packed order): its row's place in `order`
        # and its rank among the row's real tokens.
        place = torch.empty_like(order)
        place[order] = torch.arange(batch)
        token_row = torch.div(self.index, self.length, rounding_mode="floor")
        token_place = place[token_row]
        rank = (keep.cumsum(1) - 1).reshape(-1).index_select(0, self.index)
        groups = []
        for start, end in bounds:
            width = max(ordered[end - 1], 1)
            rows = ((token_place >= start) & (token_place < end)).nonzero().squeeze(1)
            slots = (token_place[rows] - start) * width + rank[rows]
            mask = torch.arange(width)[None] < lengths[order[start:end]][:, None]
            groups.append(AttentionGroup(rows, slots, mask))
        self._groups = groups
        return groups

    def merge(self, parts, groups):
        """(n_g, C) per group -> (n, C) in packed order."""
        rows = torch.cat([g.rows for g in groups])
        values = torch.cat(parts)
        return values.new_empty(len(self.index), values.shape[-1]).index_copy(0, rows, values)


# The last decision of `token_packing`: every block of a forward pass gets
# the same mask tensor, and packs it the same way. (weak reference to the
# mask, its version, the settings, the packing or None)
_LAST = [None]


def token_packing(inputs, padding_mask):
    """A `TokenPacking` for eager CPU tensors with enough padding, else None.

    On a CPU the dense layers are most of a block's time and scale with the
    rows they get; a GPU step is captured or compiled with fixed shapes,
    which a data-dependent token count would break."""
    if not isinstance(inputs, torch.Tensor) or inputs.device.type != "cpu" or inputs.ndim != 3:
        return None
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or getattr(_PLAIN, "on", False):
        return None  # a trace would freeze this batch's token count and groups
    mask = ops.convert_to_tensor(padding_mask)
    if tuple(mask.shape) != tuple(inputs.shape[:2]):
        return None
    settings = (PACK_MIN_PADDING, GROUP_COST)
    last = _LAST[0]
    if last is not None and last[0]() is mask and last[1:3] == (mask._version, settings):
        return last[3]
    keep = mask != 0
    little_padding = int(keep.sum()) > (1.0 - PACK_MIN_PADDING) * keep.numel()
    packing = None if little_padding else TokenPacking(keep)
    _LAST[0] = (weakref.ref(mask), mask._version, settings, packing)
    return packing


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


def gather_positions(x, positions):
    """x (B, T, H), positions (B, P) -> (B, P, H): one `gather` on the
    positions expanded to (B, P, H), whose sizes `torch.export` keeps
    symbolic (`take_along_dim`'s broadcasting fixed them)."""
    x = torch.as_tensor(x)
    index = torch.as_tensor(positions, device=x.device).long()
    return torch.gather(x, 1, index[:, :, None].expand(-1, -1, x.shape[-1]))


def fill_padding(x, padding_mask, value):
    """`kbert.backend.ops.fill_padding`: `masked_fill` with the number."""
    x = ops.convert_to_tensor(x)
    return x.masked_fill(ops.convert_to_tensor(padding_mask) == 0, value)
