"""Length-bucketed batches for a task's `fit`, `evaluate` and `predict`.

Shapes: N examples, C choices (multiple choice only), T the padded length
of the inputs, L a bucket length (L <= T).

Real text is short and of mixed length, and inputs arrive padded to one
length T (the preprocessor's `sequence_length`, or the user's). Each batch
here is cut to its longest sequence rounded up to a multiple of `MULTIPLE`:
the columns removed are padding in every row, masked out of attention, so
outputs and losses are those of full-length padding (to float rounding),
for a fraction of the work. A compiled backend (XLA on JAX and TensorFlow,
CUDA graphs on torch) builds one program per bucket length, not one per
length; in training one more for a final partial batch.

Order: `fit` sees every example exactly once per epoch, in the order of the
global numpy generator (seeded by `keras.utils.set_random_seed`), as Keras'
own array adapter does; `group_by_length` batches examples of similar
length together (sorted inside chunks of 50 batches, then the batch order
shuffled), like transformers' `group_by_length`. `evaluate` and `predict`
run in length order (losses and metrics are sums over examples;
predictions are returned in input order).

Packed rows (`PackedBatches`, `fit(pack_rows=...)` of `BertClassifier`):
the same batches, each placed several examples to a row, attention kept
inside each example; for backends that cannot skip padding (JAX on a CPU).
"""

import keras
import numpy as np

from kbert.backend import (
    compiles_per_shape,
    is_tensorflow,
    is_torch,
    jax_on_accelerator,
    on_accelerator,
    trainer,
)

# Bucket lengths are multiples of this where each new length is compiled or
# captured: 16 compiles at most 8 programs for T = 128 and wastes at most 15
# columns per batch (see benchmarks/RESULTS.md).
MULTIPLE = 16
# JAX on a GPU or TPU compiles each length for seconds: `predict` there
# buckets to multiples of 64 (two programs for T = 128).
ACCELERATOR_MULTIPLE = 64
# ... except `predict` on host arrays, whose bucket programs compile ahead,
# side by side (`kbert.backend.jax_compile.compile_predict_ahead`): 32,
# faster first and later calls (benchmarks/RESULTS.md).
ACCELERATOR_PREDICT_MULTIPLE = 32
# Inputs with a token axis (the last), cut to the bucket length: a BERT
# encoder's, the default where a model declares none (`token_inputs()` of
# `kbert.training.pipeline.PipelineModel`).
TOKEN_INPUTS = ("token_ids", "segment_ids", "padding_mask")
# Chunk size, in batches, inside which `group_by_length` sorts.
GROUP_CHUNK = 50
# Packed rows (`PackedBatches`): the input only packed batches have; a new
# row count is worth a compilation where it saves this many batches' rows
# (a MiniLM step compiles in ~3.5 s on 2 CPU cores, where a packed batch
# of 32 short texts runs in ~0.3 s); `fit` packs by default where that
# leaves at most this share of the positions length buckets would.
PACKED_KEY = "cls_index"
PACK_SHAPE_COST = 8
# On a GPU or TPU a compilation costs thousands of steps: one row count.
ACCELERATOR_PACK_SHAPE_COST = 10_000
PACK_MAX_SHARE = 0.8
# torch replaying the training step as CUDA graphs: a new batch shape runs
# eagerly once, then is captured, which for BERT-base costs about the time
# of 100,000 token positions of replayed steps. Set below that, so that a rare
# length is merged only where it clearly pays: `fit` pads the batches of a
# rare bucket length up to a longer bucket where that costs fewer
# positions than this, over the fit's epochs (`cheapest_buckets`).
# XQuAD's 39 batches of up to 384 tokens run at one length instead of 7
# (benchmarks/RESULTS.md).
GRAPH_SHAPE_COST = 65_536


def default_multiple(model=None):
    """The multiple `bucket_lengths=True` means: `MULTIPLE` where a new
    length costs a compilation or a CUDA-graph capture; 1 for eager torch
    and for TensorFlow without XLA on a CPU, where each batch is cut to its
    longest sequence, as transformers' dynamic padding does;
    `ACCELERATOR_MULTIPLE` for JAX on a GPU or TPU, where each compilation
    costs seconds (both faster there: benchmarks/RESULTS.md)."""
    if jax_on_accelerator():
        return ACCELERATOR_MULTIPLE
    return MULTIPLE if compiles_per_shape(model) else 1


def batch_multiple(model=None):
    """The multiple `predict_on_batch` pads to: `default_multiple`, except
    `MULTIPLE` where small batches replay traces (torch on a CPU,
    `kbert.backend.torch_trace`): one trace per bucket, not per length.
    Larger batches run eagerly there and drop the padding inside each
    block."""
    if trainer.traces_inference(model):
        return MULTIPLE
    return default_multiple(model)


def predict_multiple(model=None):
    """The multiple `bucket_lengths=True` means in `predict`:
    `ACCELERATOR_PREDICT_MULTIPLE` for JAX on a GPU or TPU, elsewhere
    `default_multiple(model)`."""
    if jax_on_accelerator():
        return ACCELERATOR_PREDICT_MULTIPLE
    return default_multiple(model)


def training_multiple(model, x):
    """The multiple `bucket_lengths=True` means in `fit` and `evaluate`.

    JAX on a GPU or TPU: one shape for the whole call, the longest
    sequence of `x` rounded up to `MULTIPLE` (each bucket would compile the
    training step again, for shorter steps that do not repay it within an
    epoch: benchmarks/RESULTS.md). Elsewhere `default_multiple(model)`.
    """
    if jax_on_accelerator() and can_bucket(x):
        full = np.shape(x["padding_mask"])[-1]
        return bucket_length(int(np.max(needed_lengths(x), initial=1)), full)
    return default_multiple(model)


def training_shape_cost(model, batch_size, epochs):
    """The `shape_cost` of `fit`'s batches (`BucketedBatches`): where torch
    replays the training step as CUDA graphs, `GRAPH_SHAPE_COST` positions
    in columns of this process's rows of a batch (torch-ddp splits each
    batch), shared by the fit's epochs; else 0."""
    if not trainer.graphs_training(model):
        return 0.0
    mine = trainer.ddp_rows(batch_size)
    return GRAPH_SHAPE_COST / max(mine.stop - mine.start, 1) / max(int(epochs), 1)


def bucket_length(longest, full, multiple=MULTIPLE):
    """`longest` rounded up to a multiple of `multiple`, at most `full`."""
    return int(min(full, max(multiple, -(-int(longest) // multiple) * multiple)))


def extents(padding_mask):
    """Per example, one past its last unmasked position (over all choices):
    the columns from there on are padding. Rows without any token count 1."""
    mask = np.asarray(padding_mask) != 0
    flat = mask.reshape(mask.shape[0], -1, mask.shape[-1]).any(axis=1)  # (N, T)
    last = flat.shape[-1] - np.argmax(flat[:, ::-1], axis=-1)
    return np.where(flat.any(axis=-1), last, 1)


def needed_lengths(x):
    """Per example, the columns a cut must keep: through its last real
    token (`extents`) and through its `mask_positions` (pre-training), whose
    padded prediction slots may point at padding."""
    lengths = extents(x["padding_mask"])
    positions = x.get("mask_positions")
    if positions is not None:
        positions = np.asarray(positions).reshape(len(lengths), -1)
        lengths = np.maximum(lengths, positions.max(axis=1, initial=0) + 1)
    return lengths


def can_bucket(x, *structures):
    """Whether the inputs are host arrays (a dict with a `padding_mask`),
    and every target / weight structure is host arrays or None."""
    if not isinstance(x, dict) or "padding_mask" not in x:
        return False
    arrays = [v for v in x.values()]
    for structure in structures:
        if structure is not None:
            arrays.extend(keras.tree.flatten(structure))
    if not all(isinstance(v, np.ndarray) for v in arrays):
        return False
    n = len(x["padding_mask"])
    return n > 0 and all(v.ndim >= 1 and len(v) == n for v in arrays)


def _cut(
    x, rows, length, full, token_targets, y=None, sample_weight=None, token_inputs=TOKEN_INPUTS
):
    """Rows `rows` of (x, y, sample_weight), token axes cut to `length`."""

    def cut_x(name, value):
        value = value[rows]
        return value[..., :length] if name in token_inputs else value

    def per_token(value):
        return token_targets and value.ndim >= 2 and value.shape[-1] == full

    def cut_target(value):
        return value[rows][..., :length] if per_token(value) else value[rows]

    def cut_weight(value):
        cut = cut_target(value)
        if not per_token(value) or length == full:
            return cut
        # Per-token weights scaled by L / T: Keras' weighted metrics average
        # over the token axis before summing over batches, and a
        # "sum_over_batch_size" loss divides by B x L; scaled, both equal
        # their full-length values (a weighted-mean loss is unchanged).
        return (cut * np.asarray(length / full, cut.dtype)).astype(cut.dtype)

    batch = ({name: cut_x(name, value) for name, value in x.items()},)
    if y is not None:
        batch += (keras.tree.map_structure(cut_target, y),)
    if sample_weight is not None:
        if y is None:
            batch += (None,)
        batch += (keras.tree.map_structure(cut_weight, sample_weight),)
    return batch


class BatchList(keras.utils.PyDataset):
    """A PyDataset over ready-made batches."""

    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    @property
    def num_batches(self):
        return len(self.batches)

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, index):
        return self.batches[index]

    def as_dataset(self):
        return as_dataset(self)


class BucketedBatches(BatchList):
    """Batches of (x, y, sample_weight) host arrays cut to their bucket
    length, for Keras' `fit` / `evaluate` / `predict` on every backend.

    Args:
        x: dict of arrays (N, ..., T), with `padding_mask`.
        y, sample_weight: arrays or structures of arrays (N, ...), or None.
        batch_size: int.
        shuffle: bool. a new random order every epoch (numpy's generator).
        group_by_length: bool. batches of similar length (see module doc).
        sort: bool. length order, longest first (evaluate, predict).
        token_targets: bool. targets and weights with a last axis of T
            (per-token labels) are cut with the inputs.
        multiple: int. bucket lengths are its multiples.
        shape_cost: float. what one more bucket length costs, in columns
            of one batch (a compilation or a capture); 0: none. The bucket
            lengths are then the cheapest set (`cheapest_buckets`) for the
            first epoch's batches, each batch padded to the shortest that
            holds it.
    """

    def __init__(
        self,
        x,
        y=None,
        sample_weight=None,
        batch_size=32,
        shuffle=False,
        group_by_length=False,
        sort=False,
        token_targets=False,
        multiple=MULTIPLE,
        shape_cost=0.0,
        token_inputs=TOKEN_INPUTS,
    ):
        super().__init__([])
        self.token_inputs = tuple(token_inputs)
        self.shape_cost = float(shape_cost)
        self.length_buckets = None  # fixed by the first epoch, where shape_cost
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.batch_size = int(batch_size)
        self.shuffle, self.group_by_length, self.sort = shuffle, group_by_length, sort
        self.token_targets = token_targets
        self.multiple = multiple
        self.full = int(x["padding_mask"].shape[-1])
        self.lengths = needed_lengths(x)
        self.epochs = 0
        self.order_batches()

    def order_batches(self):
        """The batches (row indices) of the coming epoch."""
        n = len(self.lengths)
        if self.sort:
            order = np.argsort(-self.lengths, kind="stable")
        else:
            order = np.random.permutation(n) if self.shuffle else np.arange(n)
            if self.group_by_length:
                chunk = self.batch_size * GROUP_CHUNK
                order = np.concatenate(
                    [
                        part[np.argsort(-self.lengths[part], kind="stable")]
                        for part in np.split(order, range(chunk, n, chunk))
                    ]
                )
        batches = [order[i : i + self.batch_size] for i in range(0, n, self.batch_size)]
        if self.group_by_length and self.shuffle:
            batches = [batches[i] for i in np.random.permutation(len(batches))]
        self.batches = batches
        lengths = [
            bucket_length(self.lengths[rows].max(), self.full, self.multiple) for rows in batches
        ]
        if self.shape_cost and self.length_buckets is None:
            # later epochs reuse these (their batches are no longer than the longest)
            self.length_buckets = cheapest_buckets(lengths, self.shape_cost)
        if self.length_buckets:
            lengths = padded_to(lengths, self.length_buckets)
        self.batch_lengths = lengths

    def __getitem__(self, index):
        rows = self.batches[index]
        return _cut(
            self.x,
            rows,
            self.batch_lengths[index],
            self.full,
            self.token_targets,
            self.y,
            self.sample_weight,
            self.token_inputs,
        )

    def shape_key(self, index):
        """What fixes the shapes of batch `index`: (rows, bucket length)."""
        return (len(self.batches[index]), self.batch_lengths[index])

    def first_of_each_shape(self):
        """Index of the first batch of each distinct shape, in batch order."""
        first = {}  # in insertion order: the batch order
        for index in range(len(self.batches)):
            first.setdefault(self.shape_key(index), index)
        return list(first.values())

    def on_epoch_end(self):
        self.epochs += 1
        if self.shuffle:
            self.order_batches()

    def as_dataset(self):
        return as_dataset(self, self.on_epoch_end)


def pack_rows(lengths, row_length):
    """First-fit decreasing: examples of `lengths` (E,) placed in rows of
    `row_length` columns, each example's tokens side by side. Returns
    (row, start) per example and the number of rows."""
    lengths = np.asarray(lengths)
    row = np.zeros(len(lengths), np.int64)
    start = np.zeros(len(lengths), np.int64)
    used = []  # columns taken in each row
    for i in np.argsort(-lengths, kind="stable"):
        r = next((r for r, u in enumerate(used) if u + lengths[i] <= row_length), len(used))
        if r == len(used):
            used.append(0)
        row[i], start[i] = r, used[r]
        used[r] += int(lengths[i])
    return row, start, len(used)


def cheapest_buckets(counts, shape_cost):
    """The sizes to pad batches to, for batches that need `counts` (rows of
    packed batches, or columns): each distinct bucket is one more program
    to compile or graph to capture (worth `shape_cost` rows or columns of
    work), each batch padded to the smallest bucket that holds it; the set
    of least total cost (exact, by dynamic programming over the distinct
    counts)."""
    values, freq = np.unique(np.asarray(counts), return_counts=True)
    best = [0.0] + [np.inf] * len(values)
    cut = [0] * (len(values) + 1)
    for j in range(1, len(values) + 1):
        for i in range(j):
            cost = best[i] + shape_cost + values[j - 1] * freq[i:j].sum()
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets, j = [], len(values)
    while j:
        buckets.append(int(values[j - 1]))
        j = cut[j]
    return sorted(buckets)


def padded_to(counts, buckets):
    """Each count padded to the smallest of the sorted `buckets` that holds
    it; a count above them all stays as it is."""
    return [next((b for b in buckets if b >= count), count) for count in counts]


class PackedBatches(BucketedBatches):
    """`BucketedBatches` (the same batches, in the same order) with several
    examples per row: each batch of examples is placed in rows of
    `row_length` columns (`pack_rows`), and those padded to one of a few
    row counts (`cheapest_buckets`). For tasks whose outputs are per example
    (`BertClassifier`): short texts then cost their tokens, not the
    batch's longest text times its size. The inputs are those of
    `BertBackbone` with `PACKED_INPUTS`; targets and weights are per example,
    in batch order.

    Args:
        x: dict of arrays (N, T): `token_ids`, `segment_ids`, `padding_mask`.
        y, sample_weight, batch_size, shuffle, group_by_length, multiple:
            as for `BucketedBatches` (`multiple` cuts the batches when
            unpacked).
        row_length: int or None. columns per row; by default the longest
            example rounded up to `MULTIPLE`.
    """

    def __init__(
        self,
        x,
        y=None,
        sample_weight=None,
        batch_size=32,
        shuffle=False,
        group_by_length=False,
        multiple=MULTIPLE,
        row_length=None,
    ):
        self.buckets = None
        self.packing = False  # until the rows are planned
        super().__init__(
            x, y, sample_weight, batch_size, shuffle, group_by_length, multiple=multiple
        )
        self.row_length = row_length or bucket_length(self.lengths.max(), self.full)
        if self.row_length < self.lengths.max():
            raise ValueError(
                f"row_length={self.row_length} is shorter than the longest example "
                f"({self.lengths.max()} tokens)"
            )
        self.packing = True
        self.plan_rows()

    def unpack(self):
        """Serve the batches as `BucketedBatches` does, from now on."""
        self.packing = False

    def order_batches(self):
        super().order_batches()
        if self.packing:
            self.plan_rows()

    def plan_rows(self):
        """Places each batch's examples; the row buckets are fixed by the
        first epoch's batches (later epochs reuse their programs; a batch
        that needs more rows than any bucket gets its own count)."""
        self.placements = [pack_rows(self.lengths[rows], self.row_length) for rows in self.batches]
        counts = [placement[2] for placement in self.placements]
        if self.buckets is None:
            cost = ACCELERATOR_PACK_SHAPE_COST if on_accelerator() else PACK_SHAPE_COST
            self.buckets = cheapest_buckets(counts, cost * float(np.median(counts)))
        self.batch_rows = padded_to(counts, self.buckets)

    def positions(self):
        """Token positions the model computes over an epoch: (packed, as
        `BucketedBatches` would cut them)."""
        packed = sum(self.batch_rows) * self.row_length
        bucketed = sum(len(rows) * length for rows, length in zip(self.batches, self.batch_lengths))
        return packed, bucketed

    def __getitem__(self, index):
        if not self.packing:
            return super().__getitem__(index)
        rows = self.batches[index]
        row, start, _ = self.placements[index]
        shape = (self.batch_rows[index], self.row_length)
        packed = {name: np.zeros(shape, self.x[name].dtype) for name in TOKEN_INPUTS}
        packed["example_ids"] = np.zeros(shape, np.int32)
        packed["position_ids"] = np.zeros(shape, np.int32)
        for k, (i, r, s) in enumerate(zip(rows, row, start)):
            n = int(self.lengths[i])
            for name in TOKEN_INPUTS:
                packed[name][r, s : s + n] = self.x[name][i, :n]
            packed["example_ids"][r, s : s + n] = k + 1
            packed["position_ids"][r, s : s + n] = np.arange(n)
        # Keras weighs each batch's loss by the first input's leading size
        # (inputs flattened in key order): `cls_index` comes first, (E,).
        packed[PACKED_KEY] = (row * self.row_length + start).astype(np.int32)
        batch = (packed,)
        if self.y is not None:
            batch += (keras.tree.map_structure(lambda v: v[rows], self.y),)
        if self.sample_weight is not None:
            if self.y is None:
                batch += (None,)
            batch += (keras.tree.map_structure(lambda v: v[rows], self.sample_weight),)
        return batch

    def shape_key(self, index):
        if not self.packing:
            return super().shape_key(index)
        return (len(self.batches[index]), self.batch_rows[index], self.row_length)


def can_pack(model, x, y, sample_weight):
    """Whether `fit` can pack rows for `model` on these inputs: a task with
    per-example outputs (`packs_rows`), host arrays of the backbone's three
    inputs, every example with a real token, per-example targets and
    weights. (Not under data parallelism: `Task.fit` checks that.)"""
    if not getattr(model, "packs_rows", False) or not can_bucket(x, y, sample_weight):
        return False
    if set(x) != set(TOKEN_INPUTS) or any(np.ndim(v) != 2 for v in x.values()):
        return False
    # an example of padding only attends everywhere in its row (see
    # `ops.attention_keep`): packed, that would be other examples
    return bool(np.asarray(x["padding_mask"]).any(axis=-1).all())


def packs_by_default():
    """Whether `fit(pack_rows=None)` considers packing: on JAX on a CPU
    (every other backend there runs blocks on the real tokens; on a GPU or
    TPU JAX runs one length per `fit`)."""
    return not (is_torch() or is_tensorflow() or jax_on_accelerator())


def packing_pays(packed_batches):
    """Where `fit(pack_rows=None)` packs: where `packs_by_default()` and
    packing leaves at most `PACK_MAX_SHARE` of the positions of length
    buckets."""
    if not packs_by_default():
        return False
    packed, bucketed = packed_batches.positions()
    return packed <= PACK_MAX_SHARE * bucketed


def unsort(parts, batches, n):
    """Outputs of batches run in some row order -> outputs in input order.
    `parts`: per batch, a structure of arrays (rows, ...)."""

    def place(*values):
        first = values[0]
        out = np.zeros((n,) + first.shape[1:], first.dtype)
        for rows, value in zip(batches, values):
            out[rows] = value
        return out

    return keras.tree.map_structure(place, *parts)


def pad_token_axis(value, full, fill=0.0):
    """(B, L, ...) per-token outputs -> (B, T, ...), the new positions `fill`."""
    length = value.shape[1]
    if length == full:
        return value
    pad = [(0, 0)] * value.ndim
    pad[1] = (0, full - length)
    return np.pad(value, pad, constant_values=fill)


# `predict_on_batch` on JAX or TensorFlow on a CPU cuts a batch to its rows'
# bucket, or splits it into 2 or 4 groups of rows of similar length, each
# cut to its own bucket, where that saves at least a tenth of the work;
# each group has at least 8 rows.
SPLIT_COUNTS = (2, 4)
SPLIT_MIN_ROWS = 8
SPLIT_MIN_SAVING = 0.1


def splits_batches(model=None):
    """Whether `predict_on_batch` splits a batch by row length: JAX and
    TensorFlow on a CPU, where the work and its time follow the shape.
    Eager torch on a CPU runs the batch cut to its longest row (multiple
    1) and drops the rest of the padding inside each block instead
    (`kbert.backend.ops.token_packing`); on a GPU each new shape costs a
    compilation or a capture, more than a batch of a few thousand tokens
    saves by splitting."""
    return not is_torch() and not on_accelerator()


def length_groups(x, multiple=MULTIPLE, limit=None, split=True, cut=False):
    """A model-input batch -> [(rows, length)]: groups of its rows (index
    arrays, sorted by length) that together hold each row once, each with
    its bucket length: the fewest groups with the least work (rows x
    length). One group, all rows at the bucket of the batch's length,
    without `split` or where that saves less than `SPLIT_MIN_SAVING`; with
    `cut` or `multiple` 1 (a backend that runs any length without compiling
    it: `default_multiple`) that one group is cut to the bucket of the
    batch's longest row (with 1: that row's length, as transformers'
    dynamic padding does)."""
    full = int(np.shape(x["padding_mask"])[-1])
    limit = limit or full + multiple
    rows = len(x["padding_mask"])
    whole = [(np.arange(rows), max(bucket_length(full, limit, multiple), full))]
    if rows == 0:
        return whole
    needed = needed_lengths(x)
    if multiple == 1 or cut:
        whole = [(np.arange(rows), max(bucket_length(needed.max(), limit, multiple), 1))]
    if not split:
        return whole
    order = np.argsort(needed, kind="stable")

    def plan(count):
        return [
            (group, max(bucket_length(needed[group].max(), limit, multiple), 1))
            for group in np.array_split(order, count)
        ]

    def work(groups):
        return sum(len(group) * length for group, length in groups)

    counts = [1] + [count for count in SPLIT_COUNTS if rows // count >= SPLIT_MIN_ROWS]
    best = min((plan(count) for count in counts), key=work)  # ties: fewer groups
    return best if work(best) <= (1 - SPLIT_MIN_SAVING) * work(whole) else whole


def take_rows(x, rows, length, token_inputs=TOKEN_INPUTS):
    """Rows `rows` of a model-input batch, token inputs cut or padded (with
    padding) to `length`."""

    def take(name, value):
        value = np.asarray(value)[rows]
        if name not in token_inputs:
            return value
        have = value.shape[-1]
        if have >= length:
            return value[..., :length]
        widths = [(0, 0)] * value.ndim
        widths[-1] = (0, length - have)
        return np.pad(value, widths)

    return {name: take(name, value) for name, value in x.items()}


def fit_token_axis(value, full, axis=1, fill=0.0):
    """Per-token outputs cut or padded (with `fill`) on `axis` to `full`."""
    length = value.shape[axis]
    if length >= full:
        return value[(slice(None),) * axis + (slice(0, full),)]
    widths = [(0, 0)] * value.ndim
    widths[axis] = (0, full - length)
    return np.pad(value, widths, constant_values=fill)


def predict_in_groups(x, groups, run, restore, token_inputs=TOKEN_INPUTS):
    """`run` on each group of `length_groups`, outputs back in row order.

    `restore(out, full)`: one group's outputs with their token axes brought
    to the batch's length `full`."""
    full = int(np.shape(x["padding_mask"])[-1])
    if len(groups) == 1 and len(groups[0][0]) == len(x["padding_mask"]):
        return restore(run(take_rows(x, slice(None), groups[0][1], token_inputs)), full)
    parts = [
        restore(run(take_rows(x, rows, length, token_inputs)), full) for rows, length in groups
    ]
    parts = keras.tree.map_structure(np.asarray, parts)
    return unsort(parts, [rows for rows, _ in groups], len(x["padding_mask"]))


# Marks the message of an in-graph input check, so that the error raised
# from inside a tf.data iterator can be re-raised as a ValueError.
CHECK_MARK = "kbert input check: "


def map_dataset(
    data, limits, token_targets=False, bucket=True, multiple=MULTIPLE, token_inputs=TOKEN_INPUTS
):
    """A batched `tf.data` dataset of model inputs -> the same with its
    inputs checked in the pipeline (an out-of-range id fails the iterator
    with a message naming it, before any backend gathers) and, with
    `bucket`, each batch cut to its bucket length.

    `limits`: dict(vocabulary_size=, type_vocab_size=, max_sequence_length=).
    Elements are `x` or `(x, y[, sample_weight])` with `x` a dict.
    """
    import tensorflow as tf

    spec = data.element_spec
    x_spec = spec[0] if isinstance(spec, tuple) else spec
    if not isinstance(x_spec, dict) or "token_ids" not in x_spec:
        return data

    def check(x):
        asserts = []
        token_ids = x["token_ids"]
        length = tf.shape(token_ids)[-1]
        asserts.append(
            tf.debugging.Assert(
                length <= limits["max_sequence_length"],
                [
                    f"{CHECK_MARK}sequence length",
                    length,
                    f"exceeds max_sequence_length={limits['max_sequence_length']}; "
                    "truncate the inputs",
                ],
            )
        )
        for name, high in (
            ("token_ids", limits["vocabulary_size"]),
            ("segment_ids", limits["type_vocab_size"]),
            ("padding_mask", 2),
            ("mask_positions", None),
        ):
            value = x.get(name)
            if value is None or not value.dtype.is_integer:
                continue
            top = length if high is None else tf.cast(high, value.dtype)
            top = tf.cast(top, value.dtype)
            bad = tf.logical_or(value < 0, value >= top)
            asserts.append(
                tf.debugging.Assert(
                    tf.logical_not(tf.reduce_any(bad)),
                    [
                        f"{CHECK_MARK}{name} holds",
                        tf.boolean_mask(value, bad)[:1],
                        "at position",
                        tf.where(bad)[:1],
                        "outside [0,",
                        top,
                        ")",
                    ],
                    summarize=8,
                )
            )
        with tf.control_dependencies(asserts):
            return {name: tf.identity(value) for name, value in x.items()}

    def cut(x, rest):
        mask = x["padding_mask"]
        full = tf.shape(mask)[-1]
        columns = tf.reduce_any(tf.reshape(mask != 0, [-1, full]), axis=0)  # (T,)
        last = full - tf.argmax(tf.reverse(tf.cast(columns, tf.int32), [0]), output_type=tf.int32)
        extent = tf.where(tf.reduce_any(columns), last, 1)
        if "mask_positions" in x:  # a padded prediction slot may point at padding
            extent = tf.maximum(extent, tf.reduce_max(tf.cast(x["mask_positions"], tf.int32)) + 1)
        rounded = (extent + multiple - 1) // multiple * multiple
        length = tf.minimum(full, tf.maximum(multiple, rounded))
        static = mask.shape[-1]
        x = {
            name: value[..., :length] if name in token_inputs else value
            for name, value in x.items()
        }

        def cut_target(value):
            if (
                token_targets
                and static is not None
                and value.shape.rank is not None
                and value.shape.rank >= 2
                and value.shape[-1] == static
            ):
                return value[..., :length]
            return value

        rest = tuple(rest)
        if len(rest) == 2:  # (y, sample_weight): weights scaled as in `_cut`
            weights = tf.nest.map_structure(cut_target, rest[1])
            scale = tf.cast(length, tf.float32) / tf.cast(full, tf.float32)
            weights = tf.nest.map_structure(
                lambda w, original: w if w is original else w * tf.cast(scale, w.dtype),
                weights,
                rest[1],
            )
            return x, (tf.nest.map_structure(cut_target, rest[0]), weights)
        return x, tf.nest.map_structure(cut_target, rest)

    def step(*element):
        if len(element) == 1 and isinstance(element[0], dict):
            x, rest = element[0], ()
        else:
            x, rest = element[0], tuple(element[1:])
        x = check(x)
        if bucket and "padding_mask" in x and x["padding_mask"].shape.rank in (2, 3):
            x, rest = cut(x, rest)
        return (x,) + tuple(rest) if rest else x

    return data.map(step, num_parallel_calls=tf.data.AUTOTUNE)


def as_dataset(batches, on_epoch_end=None):
    """What Keras takes for a PyDataset of variable-length batches: on
    TensorFlow a `tf.data` dataset whose shapes are left unknown (Keras'
    PyDataset adapter would fix them from the first batches), elsewhere
    the PyDataset itself."""
    if not is_tensorflow():
        return batches
    import tensorflow as tf

    def spec(value):
        return tf.TensorSpec((None,) * value.ndim, tf.as_dtype(value.dtype))

    signature = keras.tree.map_structure(spec, batches[0])

    def generate():
        for index in range(len(batches)):
            yield batches[index]
        if on_epoch_end is not None:
            on_epoch_end()

    dataset = tf.data.Dataset.from_generator(generate, output_signature=signature)
    # A known cardinality: with an unknown one, Keras' TensorFlow trainer
    # counts one optimizer iteration more per epoch than it applies (the
    # learning-rate schedule and checkpoints follow that counter).
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(len(batches)))
    # Without tf.data's autotuning: its model thread, started with the
    # first iterator, is only joined when its sleep ends, and the iterator's
    # destructor waited for it, up to 8 s at the end of a `fit` on a CPU.
    # A generator of ready batches has nothing for it to tune.
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.prefetch(2).with_options(options)
