"""torch's FlexAttention for kbert's mask descriptions: the "torch-flex"
attention implementation's kernel (`kbert.layers.flex_attention` registers
it).

Shapes: B batch, T query tokens, S key tokens, N heads, D head size;
blocks of `BLOCK` queries and keys (FlexAttention's sparse block size).

`flex_attention` computes softmax(Q K^T * scale) V one tile of queries and
keys at a time (flash-style: memory linear in length) and skips the tiles a
`BlockMask` says are empty. The mask has two parts:
- `mask_mod(b, h, q, kv)`: the rules of `kbert.layers.masks.AttentionMask`
  (padding, segments, causal with a prefix, window, global tokens) written
  per query and key, which the kernel evaluates inside the tiles that are
  partly visible;
- the block structure: for each tile, empty, full (every query sees every
  key: no `mask_mod` call) or partial. It is computed from the description
  at block level (a window bounds the distance between a query block and a
  key block, a key block with no real key is empty, a block holding a global
  query or key is visible), without evaluating the (B, T, S) mask: time and
  memory (B, T / BLOCK, S / BLOCK). Tiles are marked full only where a
  window and padding alone decide (no segments, no causal rule); every
  other tile that may hold a visible pair is partial, which is exact
  because `mask_mod` then decides each pair.
The block mask is built once per mask description and shape (all layers of
a forward share it), on the device, without host synchronisation: a
training step that holds it can be captured as a CUDA graph.

A query that sees no key (only padding can be one) gets zeros: the
description's outputs there are unspecified.

The kernel runs through `torch.compile(flex_attention, dynamic=False)`,
made once (inside a region torch.compile already traces, the plain
function, which that compilation lowers). Each new shape compiles: a first
step per shape that a CUDA-graphed `fit` or `predict` runs eagerly before
capturing it. On a CPU the plain function runs (torch's reference
implementation, which materialises the scores; torch has no FlexAttention
backward on a CPU): "auto" takes "banded" there.

FlexAttention has no dropout. With attention dropout p > 0 the output is
computed from two calls: the kernel with a `score_mod` that sends the
dropped scores to -inf gives the dropped rows' normalised output O' and
their log-sum-exp L'; the kernel without dropout gives the full rows'
log-sum-exp L; then softmax-dropout's output is exp(L' - L) O' / (1 - p)
(sum over kept keys of exp(s) v divided by the sum over all keys). The
keep decision is a hash of (seed, b, h, q, kv) computed in the kernel, so
no (B, N, T, S) mask exists; the seed is drawn from torch's generator on
the device per call (a CUDA graph replay draws a new one).
"""

import warnings

import torch
from keras import ops
from torch.nn.attention import flex_attention as flex

BLOCK = 128  # FlexAttention's default sparse block size (queries and keys)
# Smaller heads are padded with zeros to this size on a GPU (the compiled
# kernel's matrix products take at least 16 columns).
MIN_HEAD_DIM = 16

# Compilations of one function torch keeps before it runs the function
# eagerly: each input shape (length buckets) and each variant (with and
# without dropout, mask parts present) is one, so the first compilation
# raises torch's limit (8 by default) to at least this.
RECOMPILE_LIMIT = 64

_KERNEL = {}


def kernel():
    """`flex_attention` compiled (`dynamic=False`), made once; the plain
    function inside a region torch.compile already traces."""
    if torch.compiler.is_compiling():
        return flex.flex_attention
    if "compiled" not in _KERNEL:
        from torch import _dynamo

        config = _dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        _KERNEL["compiled"] = torch.compile(flex.flex_attention, dynamic=False)
    return _KERNEL["compiled"]


def _reference(*args, **kwargs):
    """The plain `flex_attention` (torch's reference implementation, what
    runs on a CPU), without its warning that it is not compiled."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex.flex_attention(*args, **kwargs)


def _int_rows(x, batch):
    """A (B, L) or (L,) tensor as contiguous int32 (B, L)."""
    x = ops.convert_to_tensor(x)
    if x.dim() == 1:
        x = x[None]
    return x.to(torch.int32).expand(batch, -1).contiguous()


class MaskParts:
    """The parts of an `AttentionMask` as int32 device tensors, and the
    per-pair rule (`mask_mod`) FlexAttention evaluates."""

    def __init__(self, mask, batch, query_length, key_length, device):
        self.window = mask.window
        self.causal = mask.causal
        self.offset = key_length - query_length
        self.query_length, self.key_length = query_length, key_length

        def part(value):
            return None if value is None else _int_rows(value, batch).to(device)

        self.padding = part(mask.padding)
        self.segments = part(mask.segments)
        self.glob = part(mask.global_tokens)
        self.prefix = None
        if mask.prefix_lengths is not None:
            self.prefix = ops.convert_to_tensor(mask.prefix_lengths).to(torch.int32).to(device)
            self.prefix = self.prefix.reshape(-1).expand(batch).contiguous()

    def mask_mod(self):
        """(b, h, q, kv) -> whether query q sees key kv (the rules of
        `kbert.layers.masks`, without the fallback for queries that see
        nothing)."""
        window, causal, offset = self.window, self.causal, self.offset
        padding, segments, glob, prefix = self.padding, self.segments, self.glob, self.prefix

        def sees(b, h, q, kv):
            t = q + offset
            local = kv >= 0
            if causal:
                before = kv <= t
                if prefix is not None:
                    before = before | (kv < prefix[b])
                local = local & before
            if window is not None:
                local = local & ((t - kv).abs() <= window)
            if glob is not None:
                local = local | (glob[b, q] != 0) | (glob[b, kv] != 0)
            if segments is not None:
                local = local & (segments[b, q] == segments[b, kv])
            if padding is not None:
                local = local & (padding[b, kv] != 0)
            return local

        return sees


def _block_any_all(rows, length, blocks):
    """(B, L) int32 -> (B, K) any and all of each block of `BLOCK` entries
    (positions beyond `length` count as 0)."""
    padded = torch.nn.functional.pad(rows != 0, (0, blocks * BLOCK - length))
    padded = padded.reshape(rows.shape[0], blocks, BLOCK)
    return padded.any(-1), padded.all(-1)


def block_structure(parts, batch, device):
    """(partial, full) bool (B, 1, Tq, Sk) block masks (Tq, Sk blocks of
    `BLOCK` queries and keys): full tiles, every pair visible; partial, the
    other tiles that may hold a visible pair."""
    t_len, s_len = parts.query_length, parts.key_length
    q_blocks, k_blocks = -(-t_len // BLOCK), -(-s_len // BLOCK)
    qi = torch.arange(q_blocks, device=device, dtype=torch.int64)
    kj = torch.arange(k_blocks, device=device, dtype=torch.int64)
    q_lo = (qi * BLOCK + parts.offset)[:, None]  # (Tq, 1) positions, in key coordinates
    q_hi = (torch.clamp((qi + 1) * BLOCK, max=t_len) - 1 + parts.offset)[:, None]
    k_lo = (kj * BLOCK)[None, :]  # (1, Sk)
    k_hi = (torch.clamp((kj + 1) * BLOCK, max=s_len) - 1)[None, :]
    shape = (batch, q_blocks, k_blocks)
    possible = torch.ones(shape, dtype=torch.bool, device=device)
    full = torch.ones(shape, dtype=torch.bool, device=device)
    # tiles reaching beyond the lengths are never full (FlexAttention bounds them)
    inside = ((qi + 1) * BLOCK <= t_len)[:, None] & ((kj + 1) * BLOCK <= s_len)[None, :]
    full = full & inside[None]
    if parts.causal:
        before = (k_lo <= q_hi)[None]
        if parts.prefix is not None:
            before = before | (k_lo[None] < parts.prefix[:, None, None])
        possible = possible & before
        full = full & False
    if parts.window is not None:
        nearest = torch.clamp(torch.maximum(k_lo - q_hi, q_lo - k_hi), min=0)
        farthest = torch.maximum((q_hi - k_lo).abs(), (k_hi - q_lo).abs())
        possible = possible & (nearest <= parts.window)[None]
        full = full & (farthest <= parts.window)[None]
    if parts.glob is not None:
        g_any, _ = _block_any_all(parts.glob, t_len, q_blocks)  # (B, Tq); T == S
        gk_any, _ = _block_any_all(parts.glob, s_len, k_blocks)
        possible = possible | g_any[:, :, None] | gk_any[:, None, :]
    if parts.segments is not None:
        full = full & False
    if parts.padding is not None:
        real_any, real_all = _block_any_all(parts.padding, s_len, k_blocks)  # (B, Sk)
        possible = possible & real_any[:, None, :]
        full = full & real_all[:, None, :]
    full = full & possible
    return (possible & ~full)[:, None], full[:, None]


def _ordered(dense):
    """(B, 1, Tq, Sk) bool -> (number of blocks per row, their indices
    first): the form `BlockMask.from_kv_blocks` takes."""
    dense = dense.to(torch.int32)
    counts = dense.sum(-1, dtype=torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return counts.contiguous(), indices.contiguous()


def block_mask(mask, batch, query_length, key_length, device):
    """The `BlockMask` of an `AttentionMask` for these sizes; kept on the
    description, so the layers of one forward build it once."""
    cache = mask.__dict__.setdefault("_flex_block_masks", {})
    key = (batch, query_length, key_length, str(device))
    if key not in cache:
        parts = MaskParts(mask, batch, query_length, key_length, device)
        partial, full = block_structure(parts, batch, device)
        counts, indices = _ordered(partial)
        full_counts, full_indices = _ordered(full)
        cache[key] = flex.BlockMask.from_kv_blocks(
            counts,
            indices,
            full_counts,
            full_indices,
            BLOCK_SIZE=(BLOCK, BLOCK),
            mask_mod=parts.mask_mod(),
            seq_lengths=(query_length, key_length),
        )
    return cache[key]


def _mix(x, multiplier):
    """One round of an integer hash on non-negative int32 values below
    2^31, without overflow (16-bit halves times a 15-bit multiplier), so
    every device and dtype computes the same bits."""
    x = (x & 0xFFFF) * multiplier + (x >> 16)
    return x ^ (x >> 13)


def _keep_mod(seed, rate):
    """A `score_mod` that sends the scores of dropped pairs to -inf: pair
    (b, h, q, kv) is kept when a hash of it and `seed` (a non-negative int32
    scalar tensor below 2^30) falls below (1 - rate) * 2^24."""
    threshold = int((1.0 - rate) * (1 << 24))

    def keep(score, b, h, q, kv):
        b, h, q, kv = (i.to(torch.int32) for i in (b, h, q, kv))
        x = _mix(_mix(seed ^ q, 0x7FEB), 0x6A09)
        x = _mix(_mix(x ^ kv, 0x4F1B), 0x7A65)
        x = _mix(_mix(x ^ (b * 1024 + h), 0x5BD1), 0x6F4B)
        return torch.where((x & 0xFFFFFF) < threshold, score, float("-inf"))

    return keep


def _with_lse(run, q, k, v, **kwargs):
    """(output, natural log-sum-exp (B, N, T)) of one kernel call."""
    if hasattr(flex, "AuxRequest"):
        out, aux = run(q, k, v, return_aux=flex.AuxRequest(lse=True), **kwargs)
        return out, aux.lse
    return run(q, k, v, return_lse=True, **kwargs)


def attention(query, key, value, mask, scale, dropout=0.0):
    """query (B, T, N, D), key/value (B, S, N, D) -> (B, T, N, D):
    FlexAttention over the keys the `AttentionMask` `mask` lets each query
    see, with attention dropout `dropout` (a probability) on the
    probabilities."""
    query, key, value = (ops.convert_to_tensor(t) for t in (query, key, value))
    batch, query_length = query.shape[0], query.shape[1]
    key_length = key.shape[1]
    blocks = block_mask(mask, batch, query_length, key_length, query.device)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, N, L, D)
    depth = q.shape[-1]
    if query.is_cuda and depth < MIN_HEAD_DIM:
        # zeros added to every head: the same scores, zero extra output columns
        q, k, v = (torch.nn.functional.pad(t, (0, MIN_HEAD_DIM - depth)) for t in (q, k, v))
    run = kernel() if query.is_cuda else _reference
    try:
        return _attention(run, q, k, v, blocks, scale, dropout)[..., :depth].transpose(1, 2)
    except NotImplementedError as error:
        if query.is_cuda or "backward" not in str(error):
            raise
        raise ValueError(
            'attention_implementation="torch-flex" cannot train on a CPU: torch has no '
            'FlexAttention backward pass there; use "banded" (what "auto" takes on a CPU)'
        ) from error


def _attention(run, q, k, v, blocks, scale, dropout):
    """(B, N, T, D) -> (B, N, T, D) through the kernel `run`."""
    if not dropout:
        return run(q, k, v, block_mask=blocks, scale=scale)
    seed = torch.randint(0, 1 << 30, (), device=q.device, dtype=torch.int32)
    keep = _keep_mod(seed, dropout)
    kept, kept_lse = _with_lse(run, q, k, v, score_mod=keep, block_mask=blocks, scale=scale)
    _, lse = _with_lse(run, q, k, v, block_mask=blocks, scale=scale)  # (B, N, T)
    # exp(L' - L) / (1 - p); a row that sees no key (L = -inf) or keeps none
    # (L' = -inf) gets 0
    share = torch.exp(kept_lse - torch.where(torch.isinf(lse), 0.0, lse)) / (1.0 - dropout)
    share = torch.where(torch.isinf(kept_lse), 0.0, share)
    return kept * share[..., None].to(kept.dtype)
