"""The Adam update as one Triton kernel per variable, for the torch backend
on a GPU.

kbert's torch Adam (`torch_step.adam_update`) is ten `torch._foreach_*`
passes over every variable and its two slots, each reading and writing
memory: inside a CUDA graph that is a large share of a fine-tuning step on
short text. One kernel per variable that reads the variable, its gradient
and its slots once and writes them once does the same update in less than
half the time. Eagerly, its 200 launches cost the host about as much as
the foreach passes; inside a replayed graph they are free.

`torch._fused_adamw_` (what `torch.optim.AdamW(fused=True)` runs) would do
it too, but with torch's arithmetic: it adds epsilon to the bias-corrected
second moment (`sqrt(v) / sqrt(1 - beta_2**t) + epsilon`), Keras to the raw
one (`sqrt(v) + epsilon`, the correction folded into the step size), and
the JAX and TensorFlow backends run Keras'. This kernel computes Keras'
update, operation for operation in float32 (up to rounding: the kernel
may fuse a multiply and an add, as torch's foreach kernels may):

    m = m * beta_1 + g * (1 - beta_1)
    v = v * beta_2 + g * g * (1 - beta_2)
    x = x - (m * alpha) / (sqrt(v) + epsilon)

with `alpha` (the learning rate times the bias corrections) read from a
device scalar, so a CUDA graph replays it with each step's value. Division
and square root round to nearest, as torch's do.

Used where Triton imports and launches (tried once per device), every
tensor is a contiguous float32 tensor on one CUDA device (Keras' variables
and slots are), outside `torch.compile`; elsewhere the foreach update
runs.
"""

import functools
import threading
import warnings

import torch

BLOCK = 1024  # elements per program
WARPS = 4


@functools.cache
def _adam_kernel():
    """The jitted kernel, or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit(do_not_specialize=["n"])
    def adam(
        x_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        alpha_ptr,
        n,
        beta_1,
        one_minus_beta_1,
        beta_2,
        one_minus_beta_2,
        epsilon,
        BLOCK: tl.constexpr,
    ):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        alpha = tl.load(alpha_ptr)
        g = tl.load(g_ptr + offsets, mask=inside)
        m = tl.load(m_ptr + offsets, mask=inside)
        v = tl.load(v_ptr + offsets, mask=inside)
        x = tl.load(x_ptr + offsets, mask=inside)
        m = m * beta_1 + g * one_minus_beta_1
        v = v * beta_2 + (g * g) * one_minus_beta_2
        x = x - tl.div_rn(m * alpha, tl.sqrt_rn(v) + epsilon)
        tl.store(m_ptr + offsets, m, mask=inside)
        tl.store(v_ptr + offsets, v, mask=inside)
        tl.store(x_ptr + offsets, x, mask=inside)

    return adam, triton.cdiv


# Held while the kernel is made or first launched: a warm-up thread's and
# a step's do it once.
_LOCK = threading.RLock()


def _kernels():
    with _LOCK:
        return _adam_kernel()


def available():
    """Whether Triton imports (it ships with torch's CUDA builds on Linux)."""
    return _kernels() is not None


# device index -> whether a first launch worked there (Triton can import
# and still fail to launch: no C compiler for its launcher, a GPU it does
# not support)
_USABLE = {}


def _usable(device):
    """Whether the kernel launches on `device`: tried once per device on a
    few values, outside any graph capture on this thread (a warning says
    why not). A `fit`'s warm-up thread (`warm_up`) tries it beside the
    main thread, which captures no graph before its first update, which
    waits for the warm-up here."""
    index = _index(device)
    if index in _USABLE:
        return _USABLE[index]
    if torch.cuda.is_current_stream_capturing():
        return False  # tried at the next eager call
    with _LOCK:  # a warm-up's launch may be under way
        if index not in _USABLE:
            _USABLE[index] = _first_launch(device)
    return _USABLE[index]


def _index(device):
    return device.index if device.index is not None else torch.cuda.current_device()


def _first_launch(device):
    """Launches the kernel on a few values on `device` (Triton compiles it
    first): whether that worked."""
    try:
        kernels = _kernels()
        if kernels is None:
            return False
        x, g, m, v = (torch.zeros(4, device=device) for _ in range(4))
        alpha = torch.zeros((), device=device)
        with torch.cuda.device(device):
            _launch(*kernels, [x], [g], [m], [v], alpha, 0.9, 0.999, 1e-7)
        return True
    except Exception as error:  # the foreach passes do the update instead
        warnings.warn(
            f"kbert: the Triton Adam kernel does not run on {device} "
            f"({type(error).__name__}: {str(error)[:200]}); the update runs as "
            "torch._foreach_ passes"
        )
        return False


def warm_up(device):
    """Starts the kernel's first launch on the CUDA `device` in a
    background thread, unless done: Triton compiles the kernel then (some
    seconds on a machine whose Triton cache is empty), which a `fit`
    spends tokenizing instead of in its first step. The first update
    waits for it (`_usable`). Returns the thread, or None."""
    if device.type != "cuda" or _index(device) in _USABLE:
        return None
    # the caller's device: a new thread's current CUDA device is the first
    device = torch.device("cuda", _index(device))
    thread = threading.Thread(
        target=_usable, args=(device,), name="kbert-triton-warm-up", daemon=True
    )
    thread.start()
    return thread


def _fits(tensors):
    return all(
        t is not None
        and t.is_cuda
        and t.dtype == torch.float32
        and t.is_contiguous()
        and t.numel() < 2**31  # the kernel's offsets are 32-bit
        for t in tensors
    )


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def adam_update(variables, grads, m_list, v_list, alpha, beta_1, beta_2, epsilon):
    """Keras' Adam update of each variable in place (module docstring).
    `alpha`: a float32 device scalar; `beta_1`, `beta_2`, `epsilon`:
    Python numbers. Returns False, having changed nothing, where the
    kernel does not apply (under `torch.compile`, no Triton, a tensor that
    is not a contiguous float32 tensor on the one CUDA device of the
    others, hyperparameters that are tensors, a device where the kernel
    does not launch)."""
    if torch.compiler.is_compiling():
        return False  # torch.compile traces the foreach passes instead
    kernels = _kernels()
    if kernels is None or not alpha.is_cuda or not all(map(_number, (beta_1, beta_2, epsilon))):
        return False
    tensors = [alpha, *variables, *grads, *m_list, *v_list]
    if not _fits(tensors) or len({t.device for t in tensors}) != 1:
        return False
    shapes_match = all(
        x.shape == g.shape == m.shape == v.shape
        for x, g, m, v in zip(variables, grads, m_list, v_list, strict=True)
    )
    if not shapes_match or not _usable(alpha.device):
        return False
    beta_1, beta_2, epsilon = float(beta_1), float(beta_2), float(epsilon)
    with torch.cuda.device(alpha.device):
        _launch(*kernels, variables, grads, m_list, v_list, alpha, beta_1, beta_2, epsilon)
    return True


def _launch(kernel, cdiv, variables, grads, m_list, v_list, alpha, beta_1, beta_2, epsilon):
    for x, g, m, v in zip(variables, grads, m_list, v_list):
        n = x.numel()
        if n == 0:
            continue
        kernel[(cdiv(n, BLOCK),)](
            x,
            g,
            m,
            v,
            alpha,
            n,
            beta_1,
            1 - beta_1,
            beta_2,
            1 - beta_2,
            epsilon,
            BLOCK=BLOCK,
            num_warps=WARPS,
        )
