"""BertSeq2SeqLM: BERT for sequence generation.

Shapes: B batch, S source tokens, T target (decoder) tokens, H hidden,
V vocabulary, N heads, D head size, L layers.

Inputs (keras-hub's seq2seq names): `encoder_token_ids`,
`encoder_padding_mask` (B, S), `decoder_token_ids`, `decoder_padding_mask`
(B, T); output: the decoder's float32 logits (B, T, V), the logits at
position t predicting decoder token t + 1 (teacher forcing).

Three architectures, one forward each way (teacher-forced, cached):
- "bert2bert": a BERT encoder (the backbone) and a BERT decoder with causal
  self-attention and cross-attention to the encoder output, its LM head
  tied to the decoder's token embedding (transformers' `EncoderDecoderModel`
  with a `BertLMHeadModel` decoder; Rothe et al. 2020's BERT2BERT,
  BERT2Rnd and Rnd2Rnd, by what is warm-started).
- "shared": BERTShare: the backbone's blocks are decoder blocks; the
  encoder pass skips their cross-attention, so encoder and decoder share
  every weight they have in common (embeddings, self-attention,
  feed-forward); the LM head is tied to the shared token embedding.
- "unilm": one BERT over the packed row `[source] [target]` (segment ids 0
  and 1) with UniLM's sequence-to-sequence mask (`AttentionMask(causal=True,
  prefix_lengths=...)`: the source sees the source, each target token the
  source and the earlier targets); the LM head is tied to the embedding.
"""

import keras
from keras import ops

from kbert.layers import BertEmbeddings
from kbert.layers.decoder import TransformerDecoderBlock, block_call_cached
from kbert.layers.heads import MaskedLMHead
from kbert.models.backbone import BertBackbone
from kbert.models.preset_io import BACKBONE_OVERRIDES, directory_preprocessor, held_model
from kbert.models.pretrainer import _masked_lm_sums
from kbert.models.task import Task
from kbert.presets.io import resolve_preset

ARCHITECTURES = ("bert2bert", "shared", "unilm")
_SAME = "same"  # from_preset's decoder: the encoder's preset
INPUT_NAMES = (
    "encoder_token_ids",
    "encoder_padding_mask",
    "decoder_token_ids",
    "decoder_padding_mask",
)
# What a bert2bert decoder's config holds (BertBackbone's argument names).
DECODER_KEYS = (
    "vocabulary_size",
    "num_layers",
    "num_heads",
    "hidden_dim",
    "intermediate_dim",
    "max_sequence_length",
    "type_vocab_size",
    "dropout",
    "attention_dropout",
    "activation",
    "layer_norm_epsilon",
    "initializer_range",
)


@keras.saving.register_keras_serializable(package="kbert")
class LanguageModelHead(MaskedLMHead):
    """The masked-LM head (transform, LayerNorm, tied decoder, output bias)
    at every position: (B, T, H) -> float32 logits (B, T, V).

    Args: those of `kbert.layers.MaskedLMHead`.

    Example:
    >>> head = LanguageModelHead(vocabulary_size=20, hidden_dim=8)
    >>> tuple(head(keras.ops.ones((2, 5, 8))).shape)
    (2, 5, 20)
    """

    def build(self, sequence_output_shape):
        super().build(sequence_output_shape)

    def call(self, sequence_output):
        x = self.layer_norm(self.transform(sequence_output))  # (B, T, E)
        if self.token_embedding is not None:
            logits = self.token_embedding(x, reverse=True)  # (B, T, V)
        else:
            logits = ops.matmul(x, ops.cast(self.decoder_kernel, self.compute_dtype))
        return ops.cast(logits, "float32") + ops.cast(self.output_bias, "float32")

    def compute_output_shape(self, sequence_output_shape):
        return tuple(sequence_output_shape[:-1]) + (self.vocabulary_size,)

    def compute_output_spec(self, sequence_output):
        return keras.KerasTensor(self.compute_output_shape(sequence_output.shape), "float32")


def unilm_row(encoder_token_ids, encoder_padding_mask, decoder_token_ids, decoder_padding_mask):
    """The packed UniLM row of a batch: token, segment, padding and position
    ids (B, S + T) and the prefix lengths (B,) of its mask. The source keeps
    its padding (S columns, the prefix), so position ids count each row's
    real source tokens, then its target tokens."""
    token_ids = ops.concatenate([encoder_token_ids, decoder_token_ids], axis=1)
    segment_ids = ops.concatenate(
        [ops.zeros_like(encoder_token_ids), ops.ones_like(decoder_token_ids)], axis=1
    )
    encoder_padding_mask = ops.cast(encoder_padding_mask, "int32")
    decoder_padding_mask = ops.cast(decoder_padding_mask, "int32")
    padding_mask = ops.concatenate([encoder_padding_mask, decoder_padding_mask], axis=1)
    source_lengths = ops.sum(encoder_padding_mask, axis=1, keepdims=True)  # (B, 1)
    positions = ops.concatenate(
        [
            ops.cumsum(encoder_padding_mask, axis=1) - 1,
            source_lengths + ops.cumsum(decoder_padding_mask, axis=1) - 1,
        ],
        axis=1,
    )
    prefix_lengths = ops.sum(ops.ones_like(encoder_padding_mask), axis=1)  # (B,): S
    return {
        "token_ids": token_ids,
        "segment_ids": segment_ids,
        "padding_mask": padding_mask,
        "position_ids": ops.maximum(positions, 0),
        "prefix_lengths": prefix_lengths,
    }


@keras.saving.register_keras_serializable(package="kbert")
class UniLMPacking(keras.layers.Layer):
    """The four seq2seq inputs -> the packed UniLM row (`unilm_row`)."""

    def call(self, inputs):
        return unilm_row(*(inputs[name] for name in INPUT_NAMES))

    def compute_output_spec(self, inputs):
        batch = inputs["encoder_token_ids"].shape[0]
        s, t = inputs["encoder_token_ids"].shape[1], inputs["decoder_token_ids"].shape[1]
        length = None if s is None or t is None else s + t
        names = ("token_ids", "segment_ids", "padding_mask", "position_ids")
        # one KerasTensor each: the graph tells outputs apart by identity
        spec = {name: keras.KerasTensor((batch, length), "int32") for name in names}
        return {**spec, "prefix_lengths": keras.KerasTensor((batch,), "int32")}


@keras.saving.register_keras_serializable(package="kbert")
class TargetPart(keras.layers.Layer):
    """(B, S + T, H) packed states -> the last T, those of the target."""

    def call(self, states, decoder_token_ids):
        return states[:, ops.shape(states)[1] - ops.shape(decoder_token_ids)[1] :]

    def compute_output_shape(self, states_shape, decoder_token_ids_shape):
        return (states_shape[0], decoder_token_ids_shape[1], states_shape[2])


def _token_id(tokenizer, token):
    vocabulary = getattr(tokenizer, "vocabulary", None)
    if vocabulary is None:
        return None
    index = {t: i for i, t in enumerate(vocabulary)} if isinstance(vocabulary, list) else None
    return index.get(token) if index is not None else vocabulary.get(token)


@keras.saving.register_keras_serializable(package="kbert")
class BertSeq2SeqLM(Task):
    """BERT for sequence generation: "bert2bert", "shared" (BERTShare) or
    "unilm" (see the module docstring), trained teacher-forced and decoded
    with `generate`.

    Args:
        backbone: `kbert.BertBackbone`. the encoder ("bert2bert"), the
            shared encoder-decoder with `block_type="bert_decoder"`
            ("shared"; `BertSeq2SeqLM.from_backbone` converts a plain one),
            or the one BERT ("unilm").
        preprocessor: `kbert.BertPreprocessor` or None. text -> ids for
            `fit` and `generate` on raw strings.
        architecture: str. "bert2bert", "shared" or "unilm".
        decoder_config: dict or None. the bert2bert decoder's
            `BertBackbone`-style sizes (`DECODER_KEYS`); None: the
            backbone's. Its `hidden_dim` must be the backbone's.
        start_token_id: int or None. the first decoder token (transformers'
            `decoder_start_token_id`); None: the preprocessor's [CLS].
        end_token_id: int or None. the token that ends a generated
            sequence; None: the preprocessor's [SEP].
        pad_token_id: int. the id after a sequence's end in generated ids.
        freeze_backbone: bool. train the decoder only.

    Example:
    >>> backbone = kbert.BertBackbone(100, 1, 2, 16, 32, max_sequence_length=16)
    >>> model = BertSeq2SeqLM(backbone, start_token_id=2, end_token_id=3)
    >>> x = {"encoder_token_ids": np.ones((1, 4), "int32"),
    ...      "encoder_padding_mask": np.ones((1, 4), "int32"),
    ...      "decoder_token_ids": np.ones((1, 3), "int32"),
    ...      "decoder_padding_mask": np.ones((1, 3), "int32")}
    >>> tuple(model(x).shape)
    (1, 3, 100)
    """

    config_names = (
        "architecture",
        "decoder_config",
        "start_token_id",
        "end_token_id",
        "pad_token_id",
        "freeze_backbone",
    )
    token_targets = True
    token_outputs = True
    targets_hint = (
        "it trains on (source texts, target texts), or on model inputs with the "
        "target ids (B, T) as y"
    )

    def __init__(
        self,
        backbone,
        preprocessor=None,
        architecture="bert2bert",
        decoder_config=None,
        start_token_id=None,
        end_token_id=None,
        pad_token_id=0,
        freeze_backbone=False,
        **kwargs,
    ):
        if architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
        if not isinstance(backbone, BertBackbone):
            raise ValueError(f"backbone must be a kbert.BertBackbone, got {type(backbone).__name__}")
        decoder_blocks = backbone.block_type == "bert_decoder"
        if architecture == "shared" and not decoder_blocks:
            raise ValueError(
                "architecture='shared' runs the decoder on the backbone's blocks, which must "
                "be decoder blocks (block_type='bert_decoder'); build the model with "
                "BertSeq2SeqLM.from_backbone(backbone, architecture='shared')"
            )
        if architecture != "shared" and decoder_blocks:
            raise ValueError(
                f"architecture={architecture!r} takes an encoder backbone (block_type 'bert'), "
                "got one with decoder blocks; use architecture='shared'"
            )
        if architecture != "bert2bert" and decoder_config is not None:
            raise ValueError(
                f"decoder_config describes the separate decoder of architecture='bert2bert'; "
                f"architecture={architecture!r} has none: leave it None"
            )
        tokenizer = getattr(preprocessor, "tokenizer", None)
        if start_token_id is None:
            start_token_id = _token_id(tokenizer, "[CLS]")
        if end_token_id is None:
            end_token_id = _token_id(tokenizer, "[SEP]")
        if architecture == "bert2bert":
            decoder_config = self._decoder_config(backbone, decoder_config)
        policy = backbone.get_layer("embeddings").dtype_policy

        # === Layers ===
        embeddings = backbone.get_layer("embeddings")
        blocks = list(backbone.transformer_layers)
        if architecture == "bert2bert":
            c = decoder_config
            embeddings = BertEmbeddings(
                c["vocabulary_size"],
                c["hidden_dim"],
                max_sequence_length=c["max_sequence_length"],
                type_vocab_size=c["type_vocab_size"],
                dropout=c["dropout"],
                layer_norm_epsilon=c["layer_norm_epsilon"],
                initializer_range=c["initializer_range"],
                dtype=policy,
                name="decoder_embeddings",
            )
            blocks = [
                TransformerDecoderBlock(
                    c["num_heads"],
                    c["hidden_dim"],
                    c["intermediate_dim"],
                    dropout=c["dropout"],
                    attention_dropout=c["attention_dropout"],
                    activation=c["activation"],
                    layer_norm_epsilon=c["layer_norm_epsilon"],
                    initializer_range=c["initializer_range"],
                    attention_implementation=backbone.attention_implementation,
                    dtype=policy,
                    name=f"decoder_layer_{i}",
                )
                for i in range(c["num_layers"])
            ]
        sizes = decoder_config or backbone.get_config()
        lm_head = LanguageModelHead(
            sizes["vocabulary_size"],
            sizes["hidden_dim"],
            activation=sizes["activation"],
            layer_norm_epsilon=sizes["layer_norm_epsilon"],
            initializer_range=sizes["initializer_range"],
            token_embedding=embeddings.token_embedding,
            embedding_dim=None if architecture == "bert2bert" else backbone.embedding_dim,
            dtype=policy,
            name="lm_head",
        )

        # === Functional model ===
        inputs = {name: keras.Input(shape=(None,), dtype="int32", name=name) for name in INPUT_NAMES}
        if architecture == "unilm":
            row = UniLMPacking(dtype=policy, name="unilm_packing")(inputs)
            x = embeddings(row["token_ids"], row["segment_ids"], position_ids=row["position_ids"])
            # causal with a prefix (`AttentionMask.of`)
            mask = {"padding": row["padding_mask"], "prefix_lengths": row["prefix_lengths"]}
            for block in blocks:
                x = block(x, attention_mask=mask)
            x = TargetPart(dtype=policy, name="target_part")(x, inputs["decoder_token_ids"])
        else:
            source = inputs["encoder_token_ids"]
            encoded = backbone(
                {
                    "token_ids": source,
                    "segment_ids": ops.zeros_like(source),
                    "padding_mask": inputs["encoder_padding_mask"],
                }
            )["sequence_output"]
            target = inputs["decoder_token_ids"]
            x = embeddings(target, ops.zeros_like(target))
            for block in blocks:
                x = block(  # causal self-attention (`TransformerDecoderBlock`)
                    x,
                    attention_mask=inputs["decoder_padding_mask"],
                    encoder_output=encoded,
                    encoder_padding_mask=inputs["encoder_padding_mask"],
                )
        outputs = lm_head(x)
        self.decoder_embeddings = embeddings
        self.decoder_blocks = blocks
        self.lm_head = lm_head
        self._init_task(
            inputs,
            outputs,
            backbone,
            preprocessor,
            {
                "architecture": architecture,
                "decoder_config": decoder_config,
                "start_token_id": start_token_id,
                "end_token_id": end_token_id,
                "pad_token_id": pad_token_id,
                "freeze_backbone": freeze_backbone,
            },
            kwargs,
        )

    @staticmethod
    def _decoder_config(backbone, decoder_config):
        if decoder_config is not None and not isinstance(decoder_config, dict):
            raise ValueError(f"decoder_config must be a dict or None, got {decoder_config!r}")
        given = dict(decoder_config or {})
        unknown = sorted(set(given) - set(DECODER_KEYS))
        if unknown:
            raise ValueError(f"decoder_config keys {unknown} are unknown; known: {DECODER_KEYS}")
        encoder = backbone.get_config()
        config = {key: given.get(key, encoder[key]) for key in DECODER_KEYS}
        if config["hidden_dim"] != backbone.hidden_dim:
            raise ValueError(
                f"decoder_config hidden_dim={config['hidden_dim']} differs from the encoder's "
                f"{backbone.hidden_dim}: the cross-attention reads the encoder output at the "
                "decoder's width; give both the same hidden_dim"
            )
        return config

    # --- training ---------------------------------------------------------

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """Mean cross-entropy over the target tokens: `y` (B, T) holds the
        ids the logits at each position should predict, weighted by the
        decoder padding mask (or `sample_weight` (B, T))."""
        if y is None:
            raise ValueError(f"{type(self).__name__} needs targets: {self.targets_hint}")
        weights = sample_weight
        if weights is None:
            weights = x["decoder_padding_mask"]
        total, weight = _masked_lm_sums(y, y_pred, weights)
        loss = total / (weight + 1e-5)
        for extra in self.losses:
            loss = loss + ops.cast(extra, "float32")
        return loss

    def input_limits(self):
        limits = super().input_limits()
        if self.architecture == "bert2bert":
            limits["vocabulary_size"] = min(
                limits["vocabulary_size"], self.decoder_config["vocabulary_size"]
            )
        return limits

    def token_inputs(self):
        return INPUT_NAMES

    # --- cached decoding (see `kbert.generation`) --------------------------

    def generation_start(self, encoder_token_ids, encoder_padding_mask, max_length):
        """The decoding state after reading the source: per-layer key/value
        caches for `max_length` decoder tokens and, for an encoder-decoder,
        the cross-attention keys and values of the encoder output."""
        dtype = self.decoder_embeddings.compute_dtype
        batch = ops.shape(encoder_token_ids)[0]
        if self.architecture == "unilm":
            return self._unilm_start(encoder_token_ids, encoder_padding_mask, max_length)
        encoded = self.backbone(
            {
                "token_ids": encoder_token_ids,
                "segment_ids": ops.zeros_like(encoder_token_ids),
                "padding_mask": encoder_padding_mask,
            },
            training=False,
        )["sequence_output"]
        state = {"encoder_padding_mask": encoder_padding_mask, "cross": [], "keys": [], "values": []}
        for block in self.decoder_blocks:
            key, value = block.cross_key_values(encoded)
            state["cross"].append((key, value))
            heads, size = block.self_attention.num_heads, block.self_attention.head_dim
            zeros = ops.zeros((batch, max_length, heads, size), dtype)
            state["keys"].append(zeros)
            state["values"].append(zeros)
        state["key_mask"] = ops.zeros((batch, max_length), "int32")
        return state

    def _unilm_start(self, encoder_token_ids, encoder_padding_mask, max_length):
        # The source's keys and values at every layer fill the first S
        # cache positions; the target's follow.
        embeddings = self.decoder_embeddings
        dtype = embeddings.compute_dtype
        batch, length = ops.shape(encoder_token_ids)[0], ops.shape(encoder_token_ids)[1]
        padding = ops.cast(encoder_padding_mask, "int32")
        positions = ops.maximum(ops.cumsum(padding, axis=1) - 1, 0)
        x = embeddings(
            encoder_token_ids, ops.zeros_like(encoder_token_ids), position_ids=positions
        )
        key_mask = ops.concatenate([padding, ops.zeros((batch, max_length), "int32")], axis=1)
        state = {"keys": [], "values": [], "key_mask": key_mask}
        for block in self.decoder_blocks:
            heads, size = block.self_attention.num_heads, block.self_attention.head_dim
            zeros = ops.zeros((batch, length + max_length, heads, size), dtype)
            x, keys, values = block_call_cached(block, x, zeros, zeros, 0, key_mask)
            state["keys"].append(keys)
            state["values"].append(values)
        state["source_lengths"] = ops.sum(padding, axis=1)  # (B,)
        state["offset"] = length
        return state

    def generation_step(self, state, token_ids, index):
        """Logits (B, V) for the token after `token_ids` (B, 1), the decoder
        token at position `index` (a scalar), and the state with its keys
        and values cached."""
        unilm = self.architecture == "unilm"
        offset = state.get("offset", 0) if unilm else 0
        slot = index + offset
        batch = ops.shape(token_ids)[0]
        key_mask = ops.slice_update(
            state["key_mask"], ops.ones((batch, 1), "int32"), (0, slot)
        )
        if unilm:
            positions = ops.reshape(state["source_lengths"] + index, (batch, 1))
            segments = ops.ones_like(token_ids)
        else:
            positions = ops.full((batch, 1), index, "int32")
            segments = ops.zeros_like(token_ids)
        x = self.decoder_embeddings(token_ids, segments, position_ids=positions)
        keys, values = [], []
        for i, block in enumerate(self.decoder_blocks):
            cross = None
            if not unilm:
                cross = (*state["cross"][i], state["encoder_padding_mask"])
            x, k, v = block_call_cached(
                block, x, state["keys"][i], state["values"][i], slot, key_mask, cross
            )
            keys.append(k)
            values.append(v)
        logits = self.lm_head(x)[:, 0]  # (B, V)
        return logits, {**state, "keys": keys, "values": values, "key_mask": key_mask}

    # --- construction -----------------------------------------------------

    @classmethod
    def from_preset(
        cls, preset, load_weights=True, architecture=None, decoder=_SAME, **kwargs
    ):
        """A seq2seq model from a preset, or warm-started from BERT presets.

        A kbert BertSeq2SeqLM preset or a Hugging Face `EncoderDecoderModel`
        directory loads as saved (when neither `architecture` nor `decoder`
        is given). Any other BERT preset or Hugging Face BERT directory is
        the encoder of a new model (`from_backbone`): for "bert2bert" the
        decoder is warm-started from `decoder` (a preset; by default the
        same as the encoder: BERT2BERT; None: random, BERT2Rnd), its
        cross-attention and LM-head transform start random.

        Args:
            preset: str or path. a registered name or a directory.
            load_weights: bool. False: the architecture, randomly initialised.
            architecture: str or None. "bert2bert" (default for a BERT
                preset), "shared" or "unilm".
            decoder: str, path or None. the bert2bert decoder's preset.
            **kwargs: other `BertSeq2SeqLM` arguments, or backbone
                overrides such as `dtype`.
        """
        directory = resolve_preset(preset, allow_pickle=kwargs.get("allow_pickle", False))
        held, _ = held_model(directory)
        if held == cls.__name__ and architecture is None and decoder is _SAME:
            return super().from_preset(directory, load_weights=load_weights, **kwargs)
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in BACKBONE_OVERRIDES}
        backbone = BertBackbone.from_preset(directory, load_weights=load_weights, **overrides)
        if "preprocessor" not in kwargs:
            kwargs["preprocessor"] = directory_preprocessor(directory, backbone)
        architecture = architecture or "bert2bert"
        if decoder is _SAME:
            decoder = backbone if architecture == "bert2bert" else None
        elif decoder is not None:
            decoder = BertBackbone.from_preset(decoder, load_weights=load_weights, **overrides)
        return cls.from_backbone(backbone, architecture, decoder=decoder, **kwargs)

    @classmethod
    def from_backbone(
        cls, backbone, architecture="bert2bert", decoder=None, preprocessor=None, **kwargs
    ):
        """A model warm-started from BERT backbones: `backbone` becomes the
        encoder (and, for "shared" and "unilm", the decoder too); for
        "bert2bert" the decoder's embeddings and blocks are copied from
        `decoder` ("same": from `backbone` too, BERT2BERT; None: random,
        BERT2Rnd). Cross-attention and the LM head's transform start random.

        Args:
            backbone: `kbert.BertBackbone` with BERT blocks.
            architecture: str. "bert2bert", "shared" or "unilm".
            decoder: `kbert.BertBackbone`, "same" or None. see above.
            preprocessor: `kbert.BertPreprocessor` or None.
            **kwargs: other `BertSeq2SeqLM` arguments.

        Example:
        >>> backbone = kbert.BertBackbone(100, 1, 2, 16, 32, max_sequence_length=16)
        >>> model = BertSeq2SeqLM.from_backbone(backbone, "shared", start_token_id=2,
        ...                                     end_token_id=3)
        >>> model.backbone.block_type
        'bert_decoder'
        """
        if architecture == "shared":
            config = {**backbone.get_config(), "block_type": "bert_decoder"}
            shared = BertBackbone.from_config(config)
            copy_weights(backbone, shared)
            backbone = shared
        if architecture != "bert2bert" and decoder is not None:
            raise ValueError(
                f"decoder= warm-starts the separate decoder of architecture='bert2bert'; "
                f"architecture={architecture!r} decodes with the backbone"
            )
        if decoder == "same":
            decoder = backbone
        if decoder is not None and "decoder_config" not in kwargs:
            kwargs["decoder_config"] = {
                key: decoder.get_config()[key] for key in DECODER_KEYS
            }
        model = cls(backbone, preprocessor=preprocessor, architecture=architecture, **kwargs)
        if decoder is not None:
            copy_weights(decoder.get_layer("embeddings"), model.decoder_embeddings)
            for source, target in zip(decoder.transformer_layers, model.decoder_blocks):
                copy_weights(source, target)
        return model


def copy_weights(source, target):
    """Copies each variable of `source` into the `target` variable at the
    same path relative to the layer (those `target` alone has keep their
    values); returns the paths copied."""
    prefix = lambda layer, v: v.path[len(layer.name) + 1 :] if v.path.startswith(layer.name + "/") else v.path  # noqa: E731
    held = {prefix(source, v): v for v in source.weights}
    copied = []
    for variable in target.weights:
        path = prefix(target, variable)
        if path in held:
            if tuple(held[path].shape) != tuple(variable.shape):
                raise ValueError(
                    f"cannot warm-start {variable.path} {tuple(variable.shape)} from "
                    f"{held[path].path} {tuple(held[path].shape)}: the sizes differ"
                )
            variable.assign(held[path])
            copied.append(path)
    return copied

