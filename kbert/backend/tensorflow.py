"""TensorFlow helpers: replica sums, replica-exact clipping, multi-worker
logs, token packing on a CPU, the fused Adam update, the int8 product. TensorFlow is imported
only when the backend is TensorFlow."""

import weakref

import keras
import numpy as np

from kbert import backend
from kbert.backend import keras_internals
from kbert.backend.state import state_of


def _replica_context():
    """The tf.distribute replica context with more than one replica, or None."""
    if not backend.is_tensorflow():
        return None
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        return context
    return None


def replica_sum(value):
    """(sum of `value` over the replicas in sync, number of replicas).

    Under a TensorFlow strategy each replica computes its loss on its slice
    of the global batch and the gradients are summed; normalising by global
    totals (not per-replica ones) makes distributed training equal to
    single-device training on the same global batch. JAX data parallelism
    computes on the global batch already, so there it is the identity.
    """
    context = _replica_context()
    if context is None:
        return value, 1
    import tensorflow as tf

    return context.all_reduce(tf.distribute.ReduceOp.SUM, value), context.num_replicas_in_sync


def clip_summed(grads, clip_by_global_norm):
    """Global-norm clipping of the *summed* gradient under a TF strategy,
    or None outside one.

    Keras clips each replica's gradients before they are summed across
    replicas, so with several replicas the clipped update differs from
    single-device training. Here the gradients are all-reduced first,
    clipped, and divided by the replica count (the optimizer's own sum then
    restores the clipped global gradient)."""
    context = _replica_context()
    if context is None:
        return None
    import tensorflow as tf

    replicas = context.num_replicas_in_sync
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)
    return [g / replicas for g in clip_by_global_norm(summed)]


def merged_rows(gradient):
    """A `tf.IndexedSlices` gradient (an embedding lookup's) with each row
    once and its values summed: the rows of the dense gradient, whose squares
    sum to its squared norm (the slices repeat a row per lookup, so their
    own values' squares do not). Anything else is returned as it is."""
    import tensorflow as tf

    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    rows, position = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(gradient.values, position, tf.shape(rows)[0])
    return tf.IndexedSlices(values, rows, gradient.dense_shape)


def multi_worker_logs(model, logs):
    """Keras' TensorFlow trainer averages logs across MultiWorkerMirrored
    workers with `strategy.reduce("MEAN", v, axis=0)`, which fails on scalar
    logs ("Invalid reduction dimension 0 for input with 0 dimensions"). Give
    them a length-1 axis there; the reduction makes them scalars again."""
    if not backend.is_tensorflow():
        return logs
    strategy = keras_internals.distribute_strategy(model)
    if strategy is None or not isinstance(logs, dict):
        return logs
    import tensorflow as tf

    if not isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) or not keras_internals.in_multi_worker_mode(strategy):
        return logs
    return {
        k: tf.reshape(v, (1,)) if tf.is_tensor(v) and v.shape.rank == 0 else v
        for k, v in logs.items()
    }


def in_xla_context():
    """Whether the code being traced will be compiled by XLA
    (`tf.function(jit_compile=True)`), where shapes must be static.
    `control_flow_util` is TensorFlow's private module (TF 2.18-2.21
    checked); without it, the answer is True (the safe one)."""
    import tensorflow as tf

    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:
        return True
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


# Per traced graph, values computed once from a tensor and shared by every
# block of a forward: the padding mask's packing index and attention mask
# (each block would otherwise rebuild them, about a dozen graph operations
# per block, which the graph executor runs one by one at small batches).
_PER_GRAPH = weakref.WeakKeyDictionary()


def per_graph(kind, tensor, make):
    """`make()`, computed once per (kind, tensor) in the graph being traced
    (each call in eager mode). The cache lives as long as the graph."""
    import tensorflow as tf

    if tf.executing_eagerly() or not hasattr(tensor, "ref") or not hasattr(tensor, "graph"):
        return make()
    graph = tf.compat.v1.get_default_graph()
    if tensor.graph is not graph:  # a captured outer tensor: computed where it is used
        return make()
    cache = _PER_GRAPH.setdefault(graph, {})
    key = (kind, tensor.ref())
    if key not in cache:
        cache[key] = make()
    return cache[key]


class TokenPacking:
    """`kbert.backend.torch_ops.TokenPacking` in TensorFlow ops: the real
    tokens of a (B, T) batch as one (n, C) matrix (a shape known only when
    the graph runs), with attention over the whole padded batch."""

    def __init__(self, keep):
        import tensorflow as tf

        self.tf = tf
        shape = tf.shape(keep, out_type=tf.int64)
        self.batch, self.length = shape[0], shape[1]
        self.index = tf.where(tf.reshape(keep, [-1]))[:, 0]  # (n,)
        self.padding_mask = keep
        self._rows = self.index[:, None]  # (n, 1): scatter indices
        self._shapes = {}  # channels -> (rows shape, batch shape), built once per graph

    def _shapes_of(self, channels):
        """([B T, C], [B, T, C]) as shape tensors, built once for `channels`."""
        if channels not in self._shapes:
            tf = self.tf
            c = tf.constant(channels, tf.int64)
            self._shapes[channels] = (
                tf.stack([self.batch * self.length, c]),
                tf.stack([self.batch, self.length, c]),
            )
        return self._shapes[channels]

    def gather(self, x):
        """(B, T, C) -> (n, C)."""
        tf = self.tf
        x = tf.convert_to_tensor(x)
        return tf.gather(tf.reshape(x, [-1, x.shape[-1]]), self.index)

    def scatter(self, x, base=None):
        """(n, C) -> (B, T, C): `base` with its real tokens' rows replaced
        by `x`; without `base`, zeros elsewhere."""
        tf = self.tf
        channels = x.shape[-1]
        rows_shape, batch_shape = self._shapes_of(channels)
        if base is None:
            rows = tf.scatter_nd(self._rows, x, rows_shape)
        else:
            base = tf.reshape(tf.convert_to_tensor(base), [-1, channels])
            rows = tf.tensor_scatter_nd_update(base, self._rows, x)
        return tf.reshape(rows, batch_shape)

    def attention_groups(self):
        """One group: the padded batch itself (see the torch version)."""
        return [self]

    def merge(self, parts, groups):
        return parts[0]


def token_packing(inputs, padding_mask):
    """A `TokenPacking` where TensorFlow runs without XLA on a CPU (Keras'
    default there), else None. Under XLA shapes must be static; on a GPU
    the data-dependent token count would stop the stream at each block."""
    if backend.on_accelerator() or in_xla_context():
        return None
    import tensorflow as tf

    if len(inputs.shape) != 3 or inputs.shape[-1] is None:
        return None
    padding_mask = tf.convert_to_tensor(padding_mask)
    return per_graph(
        "token_packing", padding_mask, lambda: TokenPacking(tf.cast(padding_mask, tf.bool))
    )


class DirectPredict:
    """`predict_on_batch` of a model on TensorFlow without XLA on a CPU,
    through one concrete function per input structure whose shapes are all
    dynamic, called directly. Keras' `predict_function` is a `tf.function`
    whose every call looks its concrete function up by hashing the call's
    type, captured variables included (about 1,100 for MobileBERT): a few
    milliseconds of a batch-1 prediction. The function runs the model's
    own `predict_step`, as Keras' does; it is made again whenever Keras
    remakes its `predict_function` (`compile`, `quantize`)."""

    def __init__(self, model):
        import tensorflow as tf

        self.keras_step = model.predict_function
        self.step = tf.function(lambda x: model.predict_step((x,)), autograph=False)
        self.functions = {}
        self.calls = 0

    def __call__(self, x):
        import tensorflow as tf

        key = tuple(sorted((name, np.dtype(v.dtype).str, v.ndim) for name, v in x.items()))
        function = self.functions.get(key)
        if function is None:
            spec = {
                name: tf.TensorSpec((None,) * v.ndim, tf.as_dtype(v.dtype)) for name, v in x.items()
            }
            function = self.functions[key] = self.step.get_concrete_function(spec)
        self.calls += 1
        out = function({name: tf.convert_to_tensor(v) for name, v in x.items()})
        return keras.tree.map_structure(lambda t: t.numpy(), out)


def direct_predict(model, x):
    """The `DirectPredict` that runs `predict_on_batch(x)`, or None where
    Keras' own call runs: XLA (`jit_compile`), an accelerator, a
    distribution strategy, inputs that are not a dict of NumPy arrays."""
    import tensorflow as tf

    if (
        not isinstance(x, dict)
        or not x
        or not all(isinstance(v, np.ndarray) and v.dtype.kind in "iufb" for v in x.values())
        or model.jit_compile
        or backend.on_accelerator()
        or tf.distribute.has_strategy()
        or keras_internals.distribute_strategy(model) is not None
    ):
        return None
    model.make_predict_function()
    state = state_of(model)
    direct = state.predict_on_batch
    if not isinstance(direct, DirectPredict) or direct.keras_step is not model.predict_function:
        direct = state.predict_on_batch = DirectPredict(model)
    return direct


def fused_adam_update(optimizer, gradient, variable, learning_rate):
    """Keras' Adam update of one variable as TensorFlow's fused kernel
    (`ResourceApplyAdam`): one pass over the variable and its slots where
    Keras' ops make about ten without XLA (Keras' TensorFlow default on a
    CPU). The kernel's arithmetic is Keras' own: alpha = lr sqrt(1 - b2^t)
    / (1 - b1^t), m += (g - m)(1 - b1), v += (g^2 - v)(1 - b2),
    x -= m alpha / (sqrt(v) + eps) (eps sqrt(1 - b2^t) for an optimizer
    with `corrected_epsilon`). Returns False, having changed nothing,
    where it does not apply: amsgrad, hyperparameters that are not Python
    numbers, variables that are not float32 resource variables."""
    import tensorflow as tf

    hyper = (optimizer.beta_1, optimizer.beta_2, optimizer.epsilon)
    if optimizer.amsgrad or not all(isinstance(h, (int, float)) for h in hyper):
        return False
    m, v = keras_internals.adam_slot_variables(optimizer, variable)
    handles = [
        getattr(x.value if isinstance(x, keras.Variable) else x, "handle", None)
        for x in (variable, m, v)
    ]
    dtypes = {keras.backend.standardize_dtype(x.dtype) for x in (variable, m, v)}
    if any(h is None for h in handles) or dtypes != {"float32"}:
        return False
    step = tf.cast(optimizer.iterations + 1, tf.float32)
    beta_1, beta_2, epsilon = (tf.constant(h, tf.float32) for h in hyper)
    beta_2_power = tf.pow(beta_2, step)
    if getattr(optimizer, "corrected_epsilon", False):  # torch's: see kbert's AdamW
        epsilon = epsilon * tf.sqrt(1.0 - beta_2_power)
    tf.raw_ops.ResourceApplyAdam(
        var=handles[0],
        m=handles[1],
        v=handles[2],
        beta1_power=tf.pow(beta_1, step),
        beta2_power=beta_2_power,
        lr=tf.cast(learning_rate, tf.float32),
        beta1=beta_1,
        beta2=beta_2,
        epsilon=epsilon,
        grad=tf.cast(tf.convert_to_tensor(gradient), tf.float32),
    )
    return True


_ONEDNN_INT8 = []


def _onednn_int8_available():
    """Whether this TensorFlow build registers oneDNN's quantized product on
    the CPU (x86 builds do; others lack the kernel). Asked once, by running
    it on a 1 x 1 product: TensorFlow has no public registry query."""
    if not _ONEDNN_INT8:
        import tensorflow as tf

        try:
            with tf.init_scope():  # eagerly, also when first asked inside a graph
                _onednn_product(tf.ones((1, 1), tf.int8), tf.ones((1, 1), tf.int8))
            _ONEDNN_INT8.append(True)
        except tf.errors.NotFoundError:
            _ONEDNN_INT8.append(False)
    return _ONEDNN_INT8[0]


def _onednn_product(x2, kernel):
    """Exact int32 x2 (M, I) @ kernel (I, O) through oneDNN's quantized
    product, which takes unsigned bytes on the left: it computes
    (x + 128) @ k, and the int32 bias -128 * colsum(k) restores x @ k."""
    import tensorflow as tf

    shifted = tf.bitcast(tf.cast(tf.cast(x2, tf.int16) + 128, tf.uint8), tf.quint8)
    bias = tf.bitcast(-128 * tf.reduce_sum(tf.cast(kernel, tf.int32), axis=0), tf.qint32)
    low, high = tf.constant(-128.0), tf.constant(127.0)
    out = tf.raw_ops.QuantizedMatMulWithBias(
        a=shifted,
        b=tf.bitcast(kernel, tf.qint8),
        bias=bias,
        min_a=low,
        max_a=high,
        min_b=low,
        max_b=high,
        Toutput=tf.qint32,
    )[0]
    return tf.bitcast(out, tf.int32)


# float32 holds every integer up to 2**24 exactly. With |x|, |k| <= 128 each
# term of an int8 product is at most 2**14, so over at most 1,024 terms every
# partial sum is an integer float32 holds: the float32 product of the int8
# values, cast back, is the int32 product, bit for bit.
EXACT_FLOAT_DEPTH = 1024
# Kernels of at most this many weights (MobileBERT's 128 x 512 and smaller)
# take the float32 product at any batch size: oneDNN's quantized product
# has a fixed cost per call (about 130 microseconds more than the float32
# product of 20 x 512 x 128 inside a graph, on a 2-core x86 CPU) that such
# thin products never repay (at 640 rows the two take the same time), while
# on wider kernels (MiniLM's 384 x 1,536: half the float32 time at 640 rows)
# it pays. Decided by the kernel's shape alone, so a graph holds one product
# per layer whatever its batch.
FLOAT_KERNEL_SIZE = 1 << 16
# Inside XLA the bfloat16 product converts the kernel on every call: from
# this many rows on (static there) it pays (see kbert.backend.jax_ops).
BF16_MIN_ROWS = 256


def int8_matmul_path(inputs=None, kernel=None):
    """Which product `int8_matmul` runs here (for this kernel, where its
    shape decides it)."""
    import tensorflow as tf

    if tf.config.list_logical_devices("GPU"):
        return "tf-matmul-int32"
    if in_xla_context():  # the oneDNN kernel is a CPU kernel, outside XLA
        rows = None if inputs is None else inputs.shape[:-1].num_elements()
        many = rows is None or rows >= BF16_MIN_ROWS
        return "tf-xla-bf16-exact" if backend.cpu_has_bf16_dot() and many else "tf-matmul-int32"
    if not _onednn_int8_available():
        return "tf-matmul-int32"
    if kernel is not None and _float_exact(kernel):
        return "tf-float32-exact"
    return "tf-onednn-int8"


def _float_exact(kernel):
    """Whether `int8_matmul` takes the float32 product for `kernel`."""
    depth, width = kernel.shape[-2], kernel.shape[-1]
    if depth is None or width is None:
        return False
    return depth <= EXACT_FLOAT_DEPTH and depth * width <= FLOAT_KERNEL_SIZE


def _float_product(x2, kernel):
    """The exact int32 product of int8 x2 (M, I <= EXACT_FLOAT_DEPTH) and
    kernel through the float32 product."""
    import tensorflow as tf

    product = tf.linalg.matmul(tf.cast(x2, tf.float32), tf.cast(kernel, tf.float32))
    return tf.cast(product, tf.int32)


def _xla_bf16_product(x2, kernel):
    """The exact int32 product of int8 x2 (M, I) and kernel inside XLA on a
    CPU with bfloat16 dot instructions: the int8 values as bfloat16 (exact)
    in float32-accumulated XLA dots over pieces of at most
    `EXACT_FLOAT_DEPTH` terms (exact there), summed in int32. XLA's CPU
    int8 -> int32 product ran at 1.3x its float32 rate, this one at 1.7x
    (TensorFlow's `matmul` has no float32 result for bfloat16 operands;
    `XlaDotV2`'s `preferred_element_type` gives one)."""
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops
    from tensorflow.compiler.xla import xla_data_pb2

    numbers = xla_data_pb2.DotDimensionNumbers()
    numbers.lhs_contracting_dimensions.append(1)
    numbers.rhs_contracting_dimensions.append(0)
    numbers = numbers.SerializeToString()
    x2 = tf.cast(x2, tf.bfloat16)
    kernel = tf.cast(kernel, tf.bfloat16)
    depth = kernel.shape[0]
    out = None
    for start in range(0, depth, EXACT_FLOAT_DEPTH):
        part = gen_xla_ops.xla_dot_v2(
            x2[:, start : start + EXACT_FLOAT_DEPTH],
            kernel[start : start + EXACT_FLOAT_DEPTH],
            numbers,
            "",
            preferred_element_type=tf.float32,
        )
        part = tf.cast(part, tf.int32)
        out = part if out is None else out + part
    return out


def int8_matmul(inputs, kernel):
    """inputs (..., I) int8 @ kernel (I, O) int8 -> (..., O) int32, exact.

    On a CPU outside XLA: oneDNN's quantized product, or for kernels of at
    most `FLOAT_KERNEL_SIZE` weights over at most `EXACT_FLOAT_DEPTH` terms
    the float32 product (exact there, and faster)."""
    import tensorflow as tf

    inputs = tf.convert_to_tensor(inputs)
    kernel = tf.convert_to_tensor(kernel)
    path = int8_matmul_path(inputs, kernel)
    if path == "tf-matmul-int32":
        return tf.linalg.matmul(inputs, kernel, output_type=tf.int32)
    lead = tf.shape(inputs)[:-1]
    x2 = tf.reshape(inputs, (-1, tf.shape(inputs)[-1]))
    if path == "tf-xla-bf16-exact":
        out = _xla_bf16_product(x2, kernel)
    elif path == "tf-float32-exact":
        out = _float_product(x2, kernel)
    else:
        out = _onednn_product(x2, kernel)
    return tf.reshape(out, tf.concat([lead, tf.shape(kernel)[-1:]], 0))
