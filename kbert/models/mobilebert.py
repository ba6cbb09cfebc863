"""MobileBertBackbone: MobileBERT (Sun et al., 2020) as a `BertBackbone`.

Shapes: B batch, T tokens, H hidden, A the blocks' bottleneck width, E
embedding table width.

The same forward as BERT (`encoder_forward`: embeddings, the blocks, the
pooler) with MobileBERT's parts (`kbert.layers.mobilebert`): the
3-token-window embeddings, bottleneck blocks from the block registry
("mobilebert"), and a pooler with or without its tanh Dense. Task models
take it as any backbone; its configs carry `backbone_type="mobilebert"`, so
presets and converters rebuild it through `BertBackbone.from_config`.
"""

import keras

from kbert.layers import Pooler, canonical_activation
from kbert.layers.attention import check_implementation_name
from kbert.layers.encoder import block_class
from kbert.layers.mobilebert import (
    FirstTokenPooler,
    MobileBertEmbeddings,
    MobileBertMaskedLMHead,
    check_normalization,
)
from kbert.layers.quantization import quantized_layers_config
from kbert.models.backbone import INPUTS, BertBackbone, encoder_forward, register_backbone
from kbert.presets.io import PresetError
from kbert.presets.loader import loader_for
from kbert.utils import checks

BACKBONE_TYPE = "mobilebert"
# the block's own arguments, beyond those every block takes
BLOCK_ARGUMENTS = (
    "bottleneck_dim",
    "use_bottleneck",
    "use_bottleneck_attention",
    "key_query_shared_bottleneck",
    "num_feedforward_networks",
    "normalization",
)


@keras.saving.register_keras_serializable(package="kbert")
class MobileBertBackbone(BertBackbone):
    """MobileBERT: 3-token-window embeddings projected from a narrow table,
    L bottleneck blocks (attention and stacked feed-forward networks at the
    inner width A, H between blocks), NoNorm, ReLU.

    Inputs and outputs are `BertBackbone`'s. The defaults are transformers'
    `MobileBertConfig` (google/mobilebert-uncased: 24 layers, H 512, A 128,
    E 128, 4 heads, 4 feed-forward networks of width 512).

    Args:
        vocabulary_size: int. number of token ids.
        num_layers: int. number of blocks L.
        num_heads: int. attention heads per block (dividing A).
        hidden_dim: int. width H between blocks.
        intermediate_dim: int. feed-forward width.
        max_sequence_length: int. number of learned positions.
        type_vocab_size: int. number of segment ids.
        dropout: float. hidden dropout.
        attention_dropout: float. attention-probability dropout.
        activation: str. feed-forward activation.
        layer_norm_epsilon: float. LayerNorm epsilon.
        initializer_range: float. stddev of the truncated-normal init.
        output_hidden_states: bool. also output every block's output.
        embedding_dim: int or None. token table width E; None: H.
        bottleneck_dim: int. the blocks' inner width A (transformers'
            `intra_bottleneck_size`).
        use_bottleneck: bool. False: blocks work at H throughout.
        use_bottleneck_attention: bool. attention inputs from the bottleneck.
        key_query_shared_bottleneck: bool. queries and keys from a second,
            shared bottleneck, values from the block's input.
        num_feedforward_networks: int. feed-forward networks per block.
        normalization: str. "no_norm" (x * gamma + beta) or "layer_norm".
        trigram_input: bool. the 3-token window embedding.
        pooler_activation: bool. pooled output = tanh(Dense(first token));
            False: the first token's state (transformers'
            `classifier_activation`).
        attention_implementation: str. see `BertBackbone`.
        dtype: str or `keras.DTypePolicy`.

    Example:
    >>> model = MobileBertBackbone(50, 2, 2, 16, 16, max_sequence_length=16,
    ...                            embedding_dim=8, bottleneck_dim=8)
    >>> x = {"token_ids": np.ones((1, 4), "int32"),
    ...      "segment_ids": np.zeros((1, 4), "int32"),
    ...      "padding_mask": np.ones((1, 4), "int32")}
    >>> tuple(model(x)["sequence_output"].shape)
    (1, 4, 16)
    """

    masked_lm_head_class = MobileBertMaskedLMHead

    def __init__(
        self,
        vocabulary_size,
        num_layers=24,
        num_heads=4,
        hidden_dim=512,
        intermediate_dim=512,
        max_sequence_length=512,
        type_vocab_size=2,
        dropout=0.0,
        attention_dropout=0.1,
        activation="relu",
        layer_norm_epsilon=1e-12,
        initializer_range=0.02,
        output_hidden_states=False,
        embedding_dim=128,
        bottleneck_dim=128,
        use_bottleneck=True,
        use_bottleneck_attention=False,
        key_query_shared_bottleneck=True,
        num_feedforward_networks=4,
        normalization="no_norm",
        trigram_input=True,
        pooler_activation=True,
        attention_implementation="auto",
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
            "bottleneck_dim",
            "num_feedforward_networks",
        )
        if embedding_dim is not None and (
            not isinstance(embedding_dim, int)
            or isinstance(embedding_dim, bool)
            or embedding_dim < 1
        ):
            raise ValueError(f"embedding_dim must be a positive int or None, got {embedding_dim!r}")
        if embedding_dim == hidden_dim and not trigram_input:
            embedding_dim = None  # no projection: the table is H wide
        for arg, value in [("dropout", dropout), ("attention_dropout", attention_dropout)]:
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{arg} must be in [0, 1), got {value!r}")
        check_normalization(normalization)
        activation = canonical_activation(activation)
        check_implementation_name(attention_implementation)
        block_options = {
            "bottleneck_dim": bottleneck_dim,
            "use_bottleneck": use_bottleneck,
            "use_bottleneck_attention": use_bottleneck_attention,
            "key_query_shared_bottleneck": key_query_shared_bottleneck,
            "num_feedforward_networks": num_feedforward_networks,
            "normalization": normalization,
        }

        # === Layers ===
        embeddings = MobileBertEmbeddings(
            vocabulary_size,
            hidden_dim,
            embedding_dim=embedding_dim,
            max_sequence_length=max_sequence_length,
            type_vocab_size=type_vocab_size,
            dropout=dropout,
            trigram_input=trigram_input,
            normalization=normalization,
            initializer_range=initializer_range,
            dtype=dtype,
            name="embeddings",
        )
        block_cls = block_class(BACKBONE_TYPE)
        blocks = [
            block_cls(
                num_heads,
                hidden_dim,
                intermediate_dim,
                dropout=dropout,
                attention_dropout=attention_dropout,
                activation=activation,
                layer_norm_epsilon=layer_norm_epsilon,
                initializer_range=initializer_range,
                attention_implementation=attention_implementation,
                dtype=dtype,
                name=f"transformer_layer_{i}",
                **block_options,
            )
            for i in range(num_layers)
        ]
        if pooler_activation:
            pooler = Pooler(hidden_dim, initializer_range, dtype=dtype, name="pooler")
        else:
            pooler = FirstTokenPooler(hidden_dim, dtype=dtype, name="pooler")

        # === Functional model ===
        inputs = {
            name: keras.Input(shape=(None,), dtype=input_dtype, name=name)
            for name, (input_dtype, _) in INPUTS.items()
        }
        outputs = encoder_forward(
            embeddings, blocks, pooler, inputs, hidden_states=output_hidden_states
        )
        # BertBackbone's constructor builds BERT's layers; the functional
        # model is initialised directly, and everything else is inherited.
        super(BertBackbone, self).__init__(inputs=inputs, outputs=outputs, dtype=dtype, **kwargs)

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
        self.embedding_dim = embedding_dim
        self.trigram_input = trigram_input
        self.pooler_activation = pooler_activation
        self.attention_implementation = attention_implementation
        for name, value in block_options.items():
            setattr(self, name, value)
        # what BertBackbone's methods read
        self.adapter_size = None
        self.share_layers = False
        self.attention_window = None  # full attention (no sliding-window MobileBERT)
        self.global_tokens = 1
        self.block_type = BACKBONE_TYPE
        self.block_options = block_options

    @property
    def backbone_type(self):
        """The `backbone_type` in this backbone's config."""
        return BACKBONE_TYPE

    @property
    def inner_dim(self):
        """The blocks' attention and feed-forward width A."""
        return self.bottleneck_dim if self.use_bottleneck else self.hidden_dim

    @classmethod
    def load_from_preset_dir(cls, directory, load_weights=True, **overrides):
        loader = loader_for(directory, overrides.get("allow_pickle", False))
        kind = loader.backbone_config().get("backbone_type")
        if kind != BACKBONE_TYPE:
            raise PresetError(
                f"{directory} holds a {kind or 'BERT'} backbone, not a MobileBERT; load it "
                "with kbert.BertBackbone.from_preset"
            )
        return super().load_from_preset_dir(directory, load_weights=load_weights, **overrides)

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "dtype": keras.saving.serialize_keras_object(self.get_layer("embeddings").dtype_policy),
            "backbone_type": BACKBONE_TYPE,
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
            "embedding_dim": self.embedding_dim,
            **{name: getattr(self, name) for name in BLOCK_ARGUMENTS},
            "trigram_input": self.trigram_input,
            "pooler_activation": self.pooler_activation,
            **quantized_layers_config(self),
            **(
                {"attention_implementation": self.attention_implementation}
                if self.attention_implementation != "auto"
                else {}
            ),
        }


register_backbone(BACKBONE_TYPE, MobileBertBackbone)
