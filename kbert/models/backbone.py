"""BertBackbone: the BERT encoder as a functional Keras model.

Shapes: B batch, T tokens, H hidden, E embedding width, L layers.
"""

import json

import keras
import numpy as np
from keras import ops

from kbert.backend import keras_internals, trainer
from kbert.backend.ops import blocks_in_loop
from kbert.layers import (
    AttentionMask,
    BertEmbeddings,
    MaskedLMHead,
    Pooler,
    canonical_activation,
    initializers,
)
from kbert.layers.attention import check_implementation_name
from kbert.layers.banded_attention import check_window, window_mask
from kbert.layers.encoder import block_class
from kbert.layers.quantization import apply_quantization, quantized_layers_config
from kbert.models import preset_io
from kbert.presets.architectures import architecture_config
from kbert.presets.io import save_backbone
from kbert.training import batching
from kbert.utils import checks

# The inputs: name -> (dtype, whether the name has a token axis, the last).
INPUTS = {
    "token_ids": ("int32", True),
    "segment_ids": ("int32", True),
    "padding_mask": ("int32", True),
}
INPUT_NAMES = tuple(INPUTS)
# A backbone with `attention_window` also takes this optional input (B, T):
# 1 for the tokens that attend globally, in place of the `global_tokens`
# rule (Longformer's `global_attention_mask`).
GLOBAL_MASK = "global_attention_mask"
# Rows that hold several examples each (`kbert.training.batching.PackedBatches`)
# add `example_ids` (R, T) (which example of the batch a token belongs to,
# from 1; 0 for padding), `position_ids` (R, T) (each example counts from 0)
# and `cls_index` (E,) (each example's first token in the flattened R x T
# rows). Attention stays inside each example, so each example's outputs are
# those it gets alone in a padded batch (to float rounding);
# `pooled_output` is then (E, H), one per example.
PACKED_INPUTS = ("example_ids", "position_ids", "cls_index")
# `encoder_forward` (not the functional graph) also takes this (B, T, E):
# vectors in place of the token embeddings (`BertEmbeddings`).
TOKEN_VECTORS = "token_vectors"
SHARED_LAYER_NAME = "shared_transformer_layer"
# Backbone classes by the `backbone_type` their configs carry (a
# BertBackbone's has none), so that `BertBackbone.from_config` of a preset's
# or a converter's config builds the class it names (`register_backbone`).
BACKBONE_TYPES = {}


def register_backbone(name, cls):
    """Makes `BertBackbone.from_config` build `cls` for configs with
    `backbone_type=name` (`cls.get_config` includes that key)."""
    BACKBONE_TYPES[name] = cls
    return cls


def is_packed(inputs):
    """Whether `inputs` are rows holding several examples (`PACKED_INPUTS`)."""
    return isinstance(inputs, dict) and "cls_index" in inputs


def encoder_forward(
    embeddings,
    blocks,
    pooler,
    inputs,
    training=None,
    run_blocks=None,
    hidden_states=False,
    window=None,
):
    """The backbone's one forward: embeddings, the blocks, the pooler. It
    builds the functional graph, and `BertBackbone.call` runs it for the
    strategies the graph cannot express (packed rows; `run_blocks`, a
    function (blocks, x, attention_mask, training) -> x, for the blocks as
    one loop). `window`: (attention_window, global_tokens, max_global,
    separator_token_id) for sliding-window attention (`window_mask`; `inputs` may hold a
    `GLOBAL_MASK`), or None. `inputs` may hold `TOKEN_VECTORS` (B, T, E),
    taken in place of the token table's lookup (`BertEmbeddings`)."""
    packed = is_packed(inputs)
    # `training` only where given: the functional graph takes it from the call
    kw = {} if training is None else {"training": training}
    at = {"position_ids": inputs["position_ids"]} if packed else {}
    if TOKEN_VECTORS in inputs:
        at[TOKEN_VECTORS] = inputs[TOKEN_VECTORS]
    x = embeddings(inputs["token_ids"], inputs["segment_ids"], **kw, **at)
    attention_mask = inputs["padding_mask"]  # (B, T): the description is padding only
    if packed:
        attention_mask = AttentionMask(
            padding=inputs["padding_mask"], segments=inputs["example_ids"]
        )
    if window is not None:  # `kbert.layers.banded_attention`
        attention_window, global_tokens, max_global, separator_id = window
        attention_mask = window_mask(
            inputs["padding_mask"],
            attention_window,
            global_tokens,
            position_ids=inputs["position_ids"] if packed else None,
            segments=inputs["example_ids"] if packed else None,
            global_mask=inputs.get(GLOBAL_MASK),
            max_global=max_global,
            segment_ids=inputs["segment_ids"],
            token_ids=inputs["token_ids"],
            separator_id=separator_id,
        )
    states = [x]
    if run_blocks is not None:
        x = run_blocks(blocks, x, attention_mask, training)
    else:
        for block in blocks:
            x = block(x, attention_mask=attention_mask, **kw)
            states.append(x)
    if packed:  # one [CLS] per example
        first = ops.take(ops.reshape(x, (-1, ops.shape(x)[-1])), inputs["cls_index"], axis=0)
        pooled = pooler(first[:, None, :])  # (E, H)
    else:
        pooled = pooler(x)
    outputs = {"sequence_output": x, "pooled_output": pooled}
    if hidden_states and run_blocks is None:
        outputs["hidden_states"] = ops.stack(states, axis=1)  # (B, L + 1, T, H)
    return outputs


def _block_signature(block):
    """What must match between blocks for one to run in place of another
    (`BertBackbone.loops_layers`), or None if a block cannot loop."""
    try:
        layers = [block, *keras_internals.flatten_layers(block)]
        if any(getattr(layer, "activity_regularizer", None) is not None for layer in layers):
            return None
        configs = [
            (
                type(layer),
                json.dumps(
                    {k: v for k, v in layer.get_config().items() if k != "name"}, sort_keys=True
                ),
            )
            for layer in layers
        ]
    except Exception:  # a layer without a (JSON) config: no loop
        return None
    variables = [
        (tuple(v.shape), str(v.dtype), bool(v.trainable))
        for v in block.trainable_variables + block.non_trainable_variables
    ]
    return configs, variables


@keras.saving.register_keras_serializable(package="kbert")
class BertBackbone(preset_io.PresetMixin, keras.Model):
    """The BERT encoder: embeddings, L post-LN Transformer blocks, pooler.

    Inputs are a dict of int tensors `token_ids`, `segment_ids` and
    `padding_mask` (1 = real token), each (B, T). Outputs are a dict with
    `sequence_output` (B, T, H), `pooled_output` (B, H) and, when
    `output_hidden_states=True`, `hidden_states` (B, L + 1, T, H): the
    embedding output followed by each layer's output (for feature-based use
    and learned layer mixtures).

    ALBERT's parameter reductions (Lan et al., 2020) are options, off by
    default: `embedding_dim` factorizes the embeddings (tables of width E,
    LayerNorm at E, then the Dense `embeddings/projection` E -> H), and
    `share_layers` applies one block, `shared_transformer_layer`, L times
    (one set of block weights; `transformer_layers` lists it L times).

    Args:
        vocabulary_size: int. number of token ids.
        num_layers: int. number of Transformer blocks L.
        num_heads: int. attention heads per block.
        hidden_dim: int. model width H.
        intermediate_dim: int. feed-forward width (4 H in the paper).
        max_sequence_length: int. number of learned positions.
        type_vocab_size: int. number of segment ids.
        dropout: float. hidden dropout.
        attention_dropout: float. attention-probability dropout; 0 lets
            training use the fused attention kernel.
        activation: str. "gelu" (exact erf) or "gelu_tanh" (approximation).
        layer_norm_epsilon: float. LayerNorm epsilon.
        initializer_range: float. stddev of the truncated-normal init.
        output_hidden_states: bool. also output every layer's hidden states.
        adapter_size: int or None. adds bottleneck adapters of this width to
            every block (Houlsby et al., 2019; identity at initialisation).
        embedding_dim: int or None. width E of the embedding tables, projected
            to H (ALBERT); None: tables of width H, no projection.
        share_layers: bool. one Transformer block applied `num_layers` times
            (ALBERT's cross-layer sharing).
        block_type: str. the block class, by its name in
            `kbert.layers.encoder.BLOCKS` ("bert": the post-LN block).
        block_options: dict or None. extra constructor arguments of that
            block class.
        attention_implementation: str. "auto" (the fastest implementation
            that can take each call) or a name in
            `kbert.layers.attention.ATTENTION_IMPLEMENTATIONS` ("explicit",
            "keras", "torch-sdpa", "jax-cudnn-flash", "banded", "torch-flex").
        attention_window: int or None. sliding-window attention
            (Longformer's): each token sees `attention_window // 2` tokens
            on each side, in memory linear in length ("banded"; on torch
            with a GPU "torch-flex"); None: full attention.
        global_tokens: int or "first_segment". with `attention_window`,
            the first this many tokens of each row see and are seen by
            every token (1: [CLS]); "first_segment": the tokens of segment
            0 ([CLS], a question and its [SEP], Longformer's choice for
            question answering; needs `max_global_tokens`);
            "before_separator" / "after_separators": for one token type
            (RoBERTa-style packing `<s> A </s></s> B </s>`), the tokens
            before the first separator (`<s>` and a question) or after the
            first separator pair (a multiple-choice ending), as
            transformers' Longformer question answering and multiple
            choice; need `max_global_tokens` and `separator_token_id`.
            An input `global_attention_mask` (B, T), 1 for the tokens that
            attend globally (Longformer's), replaces this rule for a call.
        max_global_tokens: int or None. with `attention_window`, the most
            global tokens a row of `global_attention_mask` may hold: the
            static size the window kernels gather them into, which compiled
            calls (`predict`, `fit`) need. None: counted from the mask in
            eager calls.
        separator_token_id: int or None. the separator's id (`</s>`,
            [SEP]), for the "before_separator" and "after_separators" rules.
        global_projections: bool. with `attention_window`, global tokens
            attend with projections of their own (Longformer's
            `query_global`, `key_global`, `value_global`); loading a
            preset without them copies the local ones (Longformer's
            conversion).
        dtype: str or `keras.DTypePolicy`. e.g. "float32", "mixed_bfloat16".

    Example:
    >>> model = BertBackbone(vocabulary_size=50, num_layers=2, num_heads=2,
    ...                      hidden_dim=8, intermediate_dim=16, max_sequence_length=16)
    >>> x = {"token_ids": np.ones((1, 4), "int32"),
    ...      "segment_ids": np.zeros((1, 4), "int32"),
    ...      "padding_mask": np.ones((1, 4), "int32")}
    >>> tuple(model(x)["sequence_output"].shape)
    (1, 4, 8)
    """

    # The masked-LM head class pre-training tasks put on this backbone.
    masked_lm_head_class = MaskedLMHead

    def __init__(
        self,
        vocabulary_size,
        num_layers,
        num_heads,
        hidden_dim,
        intermediate_dim,
        max_sequence_length=512,
        type_vocab_size=2,
        dropout=0.1,
        attention_dropout=0.1,
        activation="gelu",
        layer_norm_epsilon=1e-12,
        initializer_range=0.02,
        output_hidden_states=False,
        adapter_size=None,
        embedding_dim=None,
        share_layers=False,
        block_type="bert",
        block_options=None,
        attention_implementation="auto",
        attention_window=None,
        global_tokens=1,
        max_global_tokens=None,
        global_projections=False,
        separator_token_id=None,
        dtype=None,
        **kwargs,
    ):
        checks.check_positive_ints(
            locals(),
            "vocabulary_size",
            "num_layers",
            "num_heads",
            "hidden_dim",
            "intermediate_dim",
            "max_sequence_length",
            "type_vocab_size",
        )
        if hidden_dim % num_heads:
            raise ValueError(f"hidden_dim={hidden_dim} is not divisible by num_heads={num_heads}")
        if embedding_dim is not None and (
            not isinstance(embedding_dim, int)
            or isinstance(embedding_dim, bool)
            or embedding_dim < 1
        ):
            raise ValueError(
                f"embedding_dim must be a positive int (or None: no factorization), "
                f"got {embedding_dim!r}"
            )
        if not isinstance(share_layers, bool):
            raise ValueError(f"share_layers must be True or False, got {share_layers!r}")
        for arg, value in [("dropout", dropout), ("attention_dropout", attention_dropout)]:
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{arg} must be in [0, 1), got {value!r}")
        activation = canonical_activation(activation)
        check_implementation_name(attention_implementation)
        check_window(
            attention_window,
            global_tokens,
            max_global_tokens,
            global_projections,
            separator_token_id,
        )
        block_cls = block_class(block_type)
        if block_options is not None and not isinstance(block_options, dict):
            raise ValueError(f"block_options must be a dict or None, got {block_options!r}")

        # === Layers ===
        embeddings = BertEmbeddings(
            vocabulary_size,
            hidden_dim,
            max_sequence_length=max_sequence_length,
            type_vocab_size=type_vocab_size,
            dropout=dropout,
            layer_norm_epsilon=layer_norm_epsilon,
            initializer_range=initializer_range,
            embedding_dim=embedding_dim,
            dtype=dtype,
            name="embeddings",
        )

        def block(name):
            return block_cls(
                num_heads,
                hidden_dim,
                intermediate_dim,
                dropout=dropout,
                attention_dropout=attention_dropout,
                activation=activation,
                layer_norm_epsilon=layer_norm_epsilon,
                initializer_range=initializer_range,
                adapter_size=adapter_size,
                attention_implementation=attention_implementation,
                dtype=dtype,
                name=name,
                **({"global_projections": True} if global_projections else {}),
                **(block_options or {}),
            )

        if share_layers:
            # One layer called L times: the functional graph holds L nodes
            # of the same layer, so its weights exist (and are saved) once
            # and receive the sum of the L applications' gradients.
            blocks = [block(SHARED_LAYER_NAME)] * num_layers
        else:
            blocks = [block(f"transformer_layer_{i}") for i in range(num_layers)]
        pooler = Pooler(hidden_dim, initializer_range, dtype=dtype, name="pooler")

        # === Functional model ===
        inputs = {
            name: keras.Input(shape=(None,), dtype=dtype, name=name)
            for name, (dtype, _) in INPUTS.items()
        }
        # A window's description holds static sizes beside tensors, which a
        # functional graph cannot carry: with one, `call` runs this forward
        # with it (the graph's shapes are the same).
        outputs = encoder_forward(
            embeddings, blocks, pooler, inputs, hidden_states=output_hidden_states
        )
        super().__init__(inputs=inputs, outputs=outputs, dtype=dtype, **kwargs)

        # === Config ===
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.max_sequence_length = max_sequence_length
        self.type_vocab_size = type_vocab_size
        self.dropout = dropout
        self.attention_dropout = attention_dropout
        self.activation = activation
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.output_hidden_states = output_hidden_states
        self.adapter_size = adapter_size
        self.embedding_dim = embedding_dim
        self.share_layers = share_layers
        self.attention_implementation = attention_implementation
        self.attention_window = attention_window
        self.global_tokens = global_tokens
        self.max_global_tokens = max_global_tokens
        self.global_projections = global_projections
        self.separator_token_id = separator_token_id
        self.block_type = block_type
        self.block_options = dict(block_options) if block_options else None

    def call(self, inputs, training=None, mask=None, **kwargs):
        run_blocks = self._blocks_strategy(inputs)
        if run_blocks is None and not is_packed(inputs) and not self.attention_window:
            return super().call(inputs, training=training, mask=mask, **kwargs)
        return encoder_forward(
            self.get_layer("embeddings"),
            self.transformer_layers,
            self.get_layer("pooler"),
            inputs,
            training=training,
            run_blocks=run_blocks,
            hidden_states=self.output_hidden_states,
            window=self.window,
        )

    def _blocks_strategy(self, inputs):
        """How `call` runs the blocks where it does not run the functional
        graph: a function (blocks, x, attention_mask, training) -> x, or
        None for one after the other."""
        if trainer.layers_in_loop() and self.can_loop_layers(inputs):
            # a step traced for its first, fast-compiling program
            # (`kbert.backend.jax_compile`): the blocks as one loop
            def looped(blocks, x, attention_mask, training):
                x = blocks_in_loop(blocks, x, attention_mask, training)
                trainer.note_looped()
                return x

            return looped
        if (
            isinstance(inputs, dict)
            and checks.is_shapes_only(inputs.get("token_ids"))
            and self.can_loop_layers(inputs)
            and all(block.built for block in self.transformer_layers)
        ):
            # Keras' symbolic build on torch runs the model on meta tensors,
            # op by op in Python (0.5 s for BERT-base's twelve blocks). The
            # blocks are built and alike (`loops_layers`), and each keeps its
            # input's shape, so the first one's output stands for the last one's.
            return lambda blocks, x, attention_mask, training: blocks[0](
                x, attention_mask, training=training
            )
        return None

    @property
    def window(self):
        """(attention_window, global_tokens, max_global, separator_token_id)
        for `window_mask`, or None for full attention."""
        if not self.attention_window:
            return None
        return (
            self.attention_window,
            self.global_tokens,
            self.max_global_tokens,
            self.separator_token_id,
        )

    def can_loop_layers(self, inputs):
        """Whether `call` can run the blocks on `inputs` as one loop over
        stacked weights (`loops_layers`, and a (B, S) padding mask)."""
        if not isinstance(inputs, dict) or "padding_mask" not in inputs or is_packed(inputs):
            return False
        if self.attention_window:  # the loop takes a padding mask only
            return False
        return len(inputs["padding_mask"].shape) == 2 and self.loops_layers()

    def loops_layers(self):
        """Whether the blocks can run as one loop over stacked weights (the
        first block's code on each block's weights): separate blocks (not
        `share_layers`), no per-layer outputs, and blocks alike in every
        sublayer's type, configuration, dtype policy and quantization, and
        in their variables' shapes, dtypes and trainability; no activity
        regularizer (its loss would not reach the step)."""
        if self.share_layers or self.output_hidden_states or self.num_layers < 2:
            return False
        signatures = [_block_signature(block) for block in self.transformer_layers]
        return signatures[0] is not None and all(s == signatures[0] for s in signatures)

    @property
    def token_inputs(self):
        """The inputs with a token axis (`INPUTS`, and a windowed backbone's
        `global_attention_mask`), which length buckets cut."""
        names = tuple(name for name, (_, tokens) in INPUTS.items() if tokens)
        return names + ((GLOBAL_MASK,) if self.attention_window else ())

    def input_names_taken(self, inputs):
        """The names of `inputs` a call uses: `INPUT_NAMES`, and a given
        `global_attention_mask` (checked: only a windowed backbone takes one)."""
        if isinstance(inputs, dict) and GLOBAL_MASK in inputs:
            if not self.attention_window:
                self._check_global_mask(inputs)  # raises, naming the fix
            return INPUT_NAMES + (GLOBAL_MASK,)
        return INPUT_NAMES

    @property
    def token_embedding(self):
        """The `TokenEmbedding` layer, for heads that tie weights to it."""
        return self.get_layer("embeddings").token_embedding

    @property
    def transformer_layers(self):
        """The block applied at each of the L positions (with `share_layers`,
        the same layer L times)."""
        if self.share_layers:
            return [self.get_layer(SHARED_LAYER_NAME)] * self.num_layers
        return [self.get_layer(f"transformer_layer_{i}") for i in range(self.num_layers)]

    def check_inputs(self, inputs):
        """Raises a clear ValueError for ids, masks or lengths the model
        cannot take (host values only; see `kbert.utils.checks`)."""
        if not isinstance(inputs, dict):
            return
        missing = [name for name in INPUT_NAMES if name not in inputs]
        if missing:
            raise ValueError(
                f"inputs lack {missing}; BertBackbone takes a dict with {list(INPUT_NAMES)}"
            )
        checks.check_model_inputs(
            inputs, self.vocabulary_size, self.type_vocab_size, self.max_sequence_length
        )
        if GLOBAL_MASK in inputs:
            self._check_global_mask(inputs)

    def _check_global_mask(self, inputs):
        """`global_attention_mask`: a windowed backbone's, the shape of
        `token_ids`, 0/1, at most `window`'s max_global ones per row."""
        if not self.attention_window:
            raise ValueError(
                f"{GLOBAL_MASK} says which tokens attend globally in sliding-window "
                "attention; this backbone attends fully (load or build it with "
                "attention_window=...)"
            )
        value = inputs[GLOBAL_MASK]
        if tuple(value.shape) != tuple(inputs["token_ids"].shape):
            raise ValueError(
                f"{GLOBAL_MASK} has shape {tuple(value.shape)}, token_ids "
                f"{tuple(inputs['token_ids'].shape)}: give one 0/1 per token"
            )
        if not checks.is_concrete(value):
            return
        value = np.asarray(ops.convert_to_numpy(value))
        if value.size and not np.isin(value, (0, 1)).all():
            raise ValueError(f"{GLOBAL_MASK} must hold 0 and 1 only")
        real = np.asarray(ops.convert_to_numpy(inputs["padding_mask"])) != 0
        most = int((value.astype(bool) & real).sum(axis=-1).max()) if value.size else 0
        limit = self.max_global_tokens
        if limit is not None and most > limit:
            raise ValueError(
                f"a row of {GLOBAL_MASK} holds {most} global tokens, more than the "
                f"backbone's max_global_tokens={limit}; set max_global_tokens (e.g. "
                f"from_preset(..., max_global_tokens={most}))"
            )

    def __call__(self, inputs, *args, **kwargs):
        if is_packed(inputs):
            return super().__call__(inputs, *args, **kwargs)  # checked when packed
        names = self.input_names_taken(inputs)
        if isinstance(inputs, dict) and set(inputs) != set(names):
            missing = [name for name in INPUT_NAMES if name not in inputs]
            if missing:
                raise ValueError(
                    f"inputs lack {missing}; BertBackbone takes a dict with {list(INPUT_NAMES)}"
                )
            inputs = {name: inputs[name] for name in names}  # ignore extra keys
        if not checks.host_checked():
            # eager calls on concrete values (traced ones are checked on the
            # host before fit / predict send them)
            self.check_inputs(inputs)
        return super().__call__(inputs, *args, **kwargs)

    def _check_compiled_global_mask(self, x):
        """A `global_attention_mask` reaching a compiled call (predict) needs
        the static `max_global_tokens`; said here, on every backend."""
        if isinstance(x, dict) and GLOBAL_MASK in x and self.max_global_tokens is None:
            raise ValueError(
                f"predict with a {GLOBAL_MASK} needs a static number of global tokens per "
                "row: set max_global_tokens on the backbone (e.g. from_preset(..., "
                "max_global_tokens=64)); calling the backbone eagerly counts them instead"
            )

    def predict(self, x, *args, **kwargs):
        self.check_inputs(x)
        self._check_compiled_global_mask(x)
        with checks.inputs_checked_on_host():
            return super().predict(x, *args, **kwargs)

    def predict_on_batch(self, x):
        """Keras `predict_on_batch`; inputs of any length are checked, padded
        to their bucket length (a compiled backend compiles once per bucket,
        not once per length) and `sequence_output` brought back to the input
        length. On JAX and TensorFlow on a CPU a batch of rows of mixed
        length runs as groups of rows of similar length, each cut to its own
        bucket (`kbert.training.batching.length_groups`); outputs at padding
        positions beyond a group's bucket are zeros."""
        self.check_inputs(x)
        self._check_compiled_global_mask(x)
        if not (isinstance(x, dict) and all(isinstance(v, np.ndarray) for v in x.values())):
            with checks.inputs_checked_on_host():
                return super().predict_on_batch(x)
        groups = batching.length_groups(
            x,
            batching.default_multiple(self),
            self.max_sequence_length,
            split=batching.splits_batches(self),
        )
        with checks.inputs_checked_on_host():
            return batching.predict_in_groups(
                x, groups, super().predict_on_batch, self._fit_token_axes, self.token_inputs
            )

    def _fit_token_axes(self, out, full):
        """Outputs with their token axes cut or padded (zeros) to `full`."""
        out = {**out, "sequence_output": batching.fit_token_axis(out["sequence_output"], full)}
        if "hidden_states" in out:  # (B, L + 1, T, H)
            out["hidden_states"] = batching.fit_token_axis(out["hidden_states"], full, axis=2)
        return out

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "dtype": keras.saving.serialize_keras_object(self.get_layer("embeddings").dtype_policy),
            "vocabulary_size": self.vocabulary_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "hidden_dim": self.hidden_dim,
            "intermediate_dim": self.intermediate_dim,
            "max_sequence_length": self.max_sequence_length,
            "type_vocab_size": self.type_vocab_size,
            "dropout": self.dropout,
            "attention_dropout": self.attention_dropout,
            "activation": self.activation,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "initializer_range": self.initializer_range,
            "output_hidden_states": self.output_hidden_states,
            **quantized_layers_config(self),
            **({"adapter_size": self.adapter_size} if self.adapter_size else {}),
            **({"embedding_dim": self.embedding_dim} if self.embedding_dim is not None else {}),
            **({"share_layers": True} if self.share_layers else {}),
            **(
                {"attention_implementation": self.attention_implementation}
                if self.attention_implementation != "auto"
                else {}
            ),
            **(
                {"attention_window": self.attention_window, "global_tokens": self.global_tokens}
                if self.attention_window
                else {}
            ),
            **({"max_global_tokens": self.max_global_tokens} if self.max_global_tokens else {}),
            **({"global_projections": True} if self.global_projections else {}),
            **(
                {"separator_token_id": self.separator_token_id}
                if self.separator_token_id is not None
                else {}
            ),
            **({"block_type": self.block_type} if self.block_type != "bert" else {}),
            **({"block_options": self.block_options} if self.block_options else {}),
        }

    @classmethod
    @initializers.placeholders_when_loading
    def from_config(cls, config):
        config = dict(config)
        kind = config.pop("backbone_type", None)
        if kind is not None:
            if kind not in BACKBONE_TYPES:
                raise ValueError(
                    f"unknown backbone_type {kind!r}; registered: {sorted(BACKBONE_TYPES)}"
                )
            cls = BACKBONE_TYPES[kind]
        quantized = config.pop("quantized_layers", None)
        if isinstance(config.get("dtype"), dict):
            config["dtype"] = keras.saving.deserialize_keras_object(config["dtype"])
        return apply_quantization(cls(**config), quantized, "the backbone config")

    @classmethod
    def load_from_preset_dir(cls, directory, load_weights=True, **overrides):
        return preset_io.load_backbone(cls, directory, load_weights=load_weights, **overrides)

    def write_preset_files(self, directory):
        return save_backbone(directory, self)

    @classmethod
    def from_teacher(cls, teacher, layers, name=None):
        """A smaller backbone initialised from chosen blocks of `teacher`
        (DistilBERT: every other layer), for distillation.

        Same config as the teacher except `num_layers = len(layers)`; the
        embeddings, the pooler and teacher block `layers[i]` are copied
        into block i.

        Args:
            teacher: BertBackbone. the backbone to take blocks from.
            layers: sequence of int. 0-based teacher blocks, in student order.
            name: str or None. the student's name.

        Example:
        >>> teacher = BertBackbone(100, 4, 2, 16, 32, max_sequence_length=16)
        >>> BertBackbone.from_teacher(teacher, layers=[0, 2]).num_layers
        2
        """
        if not isinstance(teacher, BertBackbone):
            raise ValueError(
                f"from_teacher takes a BertBackbone, got {type(teacher).__name__} "
                "(a task model's backbone is `model.backbone`)"
            )
        layers = list(layers)
        if not layers or not all(
            isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)) for i in layers
        ):
            raise ValueError(f"layers must be a non-empty list of block indices, got {layers!r}")
        layers = [int(i) for i in layers]
        bad = [i for i in layers if not 0 <= i < teacher.num_layers]
        if bad:
            last = teacher.num_layers - 1
            raise ValueError(f"layers {bad} are not blocks of the teacher; it has blocks 0..{last}")
        config = teacher.get_config()
        if config.get("share_layers"):
            raise ValueError(
                "the teacher shares one block across its layers (share_layers=True): a student "
                "from its layers is that block again; build the student with fewer "
                "num_layers and copy the weights instead"
            )
        if config.get("quantized_layers"):
            raise ValueError(
                "the teacher has quantized layers, whose weights a float student cannot "
                "take; distil from the float teacher, and quantize the student after"
            )
        config.update(num_layers=len(layers), output_hidden_states=False)
        config["name"] = name or f"{teacher.name}_student"
        student = cls.from_config(config)
        for part in ("embeddings", "pooler"):
            student.get_layer(part).set_weights(teacher.get_layer(part).get_weights())
        for i, source in enumerate(layers):
            student.transformer_layers[i].set_weights(
                teacher.transformer_layers[source].get_weights()
            )
        return student

    @classmethod
    def from_architecture(cls, name, **overrides):
        """A randomly initialised backbone of a named size (`bert_base`, ...).

        Example:
        >>> BertBackbone.from_architecture("bert_tiny", vocabulary_size=100).num_layers
        2
        """
        return cls(**{**architecture_config(name), **overrides})
