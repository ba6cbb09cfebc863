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
import numpy as np
from keras import ops

from kbert.backend.decoding import cache_write
from kbert.backend.ops import sublayer_call
from kbert.data.seq2seq import seq2seq_features
from kbert.generation.runner import LENGTH_MULTIPLE, decoding_options, generate_ids
from kbert.layers import BertEmbeddings
from kbert.layers.decoder import TransformerDecoderBlock, block_call_cached
from kbert.layers.heads import MaskedLMHead
from kbert.models.backbone import BertBackbone
from kbert.models.preset_io import BACKBONE_OVERRIDES, directory_preprocessor, held_model
from kbert.models.pretrainer import _masked_lm_sums
from kbert.models.task import Task
from kbert.presets.io import resolve_preset
from kbert.training.raw_text import is_text
from kbert.training.seq2seq_batches import Seq2SeqBatches
from kbert.utils import checks

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
            raise ValueError(
                f"backbone must be a kbert.BertBackbone, got {type(backbone).__name__}"
            )
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
        if start_token_id is None and tokenizer is not None:
            start_token_id = int(tokenizer.cls_id)
        if end_token_id is None and tokenizer is not None:
            end_token_id = int(tokenizer.sep_id)
        if architecture == "bert2bert":
            decoder_config = self._decoder_config(backbone, decoder_config)
        # the generated ids are the decoder's
        vocabulary = (decoder_config or {}).get("vocabulary_size", backbone.vocabulary_size)
        for name, value in [
            ("start_token_id", start_token_id),
            ("end_token_id", end_token_id),
            ("pad_token_id", pad_token_id),
        ]:
            if value is not None and (
                not isinstance(value, (int, np.integer))
                or isinstance(value, bool)
                or not 0 <= value < vocabulary
            ):
                raise ValueError(
                    f"{name} must be one token id (an int in [0, {vocabulary})), got {value!r}"
                )
        start_token_id, end_token_id, pad_token_id = (
            None if v is None else int(v) for v in (start_token_id, end_token_id, pad_token_id)
        )
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
        inputs = {
            name: keras.Input(shape=(None,), dtype="int32", name=name) for name in INPUT_NAMES
        }
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
        self.decoder_embeddings = embeddings
        self.decoder_blocks = blocks
        self.lm_head = lm_head

    @property
    def adam_epsilon(self):
        """`compile`'s Adam epsilon: 1e-8 for the architectures with a new
        cross-attention, else the original BERT's 1e-6. A new
        cross-attention starts with its keys near 0, so its queries'
        gradients are tiny (about 1e-6 per weight before clipping, 100x
        below the rest of a warm-started all-MiniLM-L6-v2): against 1e-6
        their updates come out 20-40x smaller, and BERT2BERT on WikiSplit
        stalls at loss 3.6 where 1e-8 reaches 2.5 (benchmarks/RESULTS.md).
        UniLM has no new attention and scored 0.85 SARI higher with 1e-6."""
        return super().adam_epsilon if self.architecture == "unilm" else 1e-8

    def set_backbone_training(self, freeze_backbone):
        super().set_backbone_training(freeze_backbone)
        # the pooler is kept (presets and interchange hold it) but unused
        self.backbone.get_layer("pooler").trainable = False

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

    def fit(self, x=None, y=None, *args, target_length=None, **kwargs):
        """Keras `fit` (see `kbert.training.pipeline.PipelineModel.fit`) on
        (source texts, target texts): `x` the sources, `y` the targets,
        tokenized with the preprocessor (`kbert.data.seq2seq.seq2seq_features`:
        labels shifted inside, loss on target tokens only); or on model
        inputs with the labels (B, T) as `y`. `validation_data` may be
        (sources, targets) too.

        Args:
            target_length: int or None. longest decoder row for text
                targets; None: the preprocessor's sequence_length.
        """
        x, y = self.text_pairs(x, y, target_length)
        validation = kwargs.get("validation_data")
        if isinstance(validation, tuple) and len(validation) == 2:
            kwargs["validation_data"] = self.text_pairs(*validation, target_length)
        if self._bucketable(x, y, args, kwargs):
            # length buckets on both sides (`kbert.training.seq2seq_batches`),
            # the inputs checked here as the pipeline checks host arrays
            self._check_input_names(x)
            self.check_inputs(x)
            x = Seq2SeqBatches(
                x,
                y,
                batch_size=kwargs.pop("batch_size", None) or 32,
                shuffle=kwargs.pop("shuffle", True),
                multiple=LENGTH_MULTIPLE,
                # the global generator, seeded by keras.utils.set_random_seed
                seed=int(np.random.randint(1 << 31)),
            )
            y = None
        return super().fit(x, y, *args, **kwargs)

    @staticmethod
    def _bucketable(x, y, args, kwargs):
        """Host arrays with labels, and none of the options Keras' own
        batching needs (validation_split, sample weights, steps_per_epoch)."""
        if args or kwargs.get("bucket_lengths", True) is False:
            return False
        if any(
            kwargs.get(k) is not None
            for k in ("validation_split", "sample_weight", "steps_per_epoch", "class_weight")
        ):
            return False
        arrays = isinstance(x, dict) and all(isinstance(x.get(k), np.ndarray) for k in INPUT_NAMES)
        return arrays and isinstance(y, np.ndarray) and y.ndim == 2

    def evaluate(self, x=None, y=None, *args, target_length=None, **kwargs):
        """Keras `evaluate`, on (source texts, target texts) as `fit` takes them."""
        x, y = self.text_pairs(x, y, target_length)
        return super().evaluate(x, y, *args, **kwargs)

    def text_pairs(self, x, y, target_length=None):
        """(model inputs, labels) for (source texts, target texts); other
        inputs unchanged."""
        if not (is_text(x) and is_text(y)):
            return x, y
        if self.preprocessor is None:
            raise ValueError(
                f"{type(self).__name__} got raw text but has no preprocessor to tokenize "
                "it; attach one (model.preprocessor = kbert.BertPreprocessor(...))"
            )
        length = self.preprocessor.sequence_length
        x, y = seq2seq_features(
            self.preprocessor.tokenizer,
            [x] if isinstance(x, str) else x,
            [y] if isinstance(y, str) else y,
            length,
            target_length or length,
            self.start_token_id,
            self.end_token_id,
        )
        return x, y

    def check_inputs(self, x):
        """A ValueError naming the side and the bad value, for host inputs
        a backend would gather out of range (ids past a vocabulary, masks
        not 0/1, sides longer than their positions)."""
        if not isinstance(x, dict) or not all(k in x for k in INPUT_NAMES):
            return
        backbone = self.backbone
        decoder = self.decoder_config or backbone.get_config()
        source_length = np.shape(x["encoder_token_ids"])[-1]
        target_limit = decoder["max_sequence_length"]
        if self.architecture == "unilm":  # one row holds both sides
            target_limit = max(backbone.max_sequence_length - source_length, 1)
        sides = [
            ("encoder", backbone.vocabulary_size, backbone.max_sequence_length),
            ("decoder", decoder["vocabulary_size"], target_limit),
        ]
        for side, vocabulary_size, limit in sides:
            part = {
                "token_ids": x[f"{side}_token_ids"],
                "padding_mask": x[f"{side}_padding_mask"],
            }
            try:
                checks.check_model_inputs(part, vocabulary_size, backbone.type_vocab_size, limit)
            except ValueError as e:
                raise ValueError(
                    f"{side}_token_ids / {side}_padding_mask: {e}"
                    + (
                        " (a unilm row holds the source and the target)"
                        if side == "decoder" and self.architecture == "unilm"
                        else ""
                    )
                ) from None

    def _prepare_inputs(self, x, bucket):
        x = super()._prepare_inputs(x, bucket)
        self.check_inputs(x)
        return x

    def input_limits(self):
        limits = super().input_limits()
        if self.architecture == "bert2bert":
            limits["vocabulary_size"] = min(
                limits["vocabulary_size"], self.decoder_config["vocabulary_size"]
            )
        return limits

    def token_inputs(self):
        return INPUT_NAMES

    # --- generation ------------------------------------------------------

    def generate(
        self,
        inputs,
        max_length=20,
        num_beams=1,
        do_sample=False,
        temperature=1.0,
        top_k=None,
        top_p=None,
        seed=None,
        length_penalty=1.0,
        early_stopping=False,
        batch_size=None,
    ):
        """Decodes from sources with a key/value cache, as transformers'
        `generate` does: greedy by default, beam search with `num_beams`
        (`length_penalty`, `early_stopping`), sampling with `do_sample`
        (`temperature`, `top_k`, `top_p`, `seed`: the same seed, the same
        output). The loop runs as one compiled program per (batch, source
        length bucket, options) on JAX and TensorFlow; on torch as one step
        per token, replayed as a CUDA graph per shapes on a GPU
        (`kbert.generation.runner`, `decoding_path`).

        Args:
            inputs: raw strings (a list, or one str) -> generated strings;
                or a dict of `encoder_token_ids` and `encoder_padding_mask`
                (B, S) -> int ids (B, L): the start token, the generated
                tokens up to and including the end token, then padding.
            max_length: int. the longest output in decoder tokens, the start
                token included (transformers' `max_length`).
            num_beams, do_sample, temperature, top_k, top_p, seed,
                length_penalty, early_stopping: as in transformers.
            batch_size: int or None. rows per program call (None: all).

        Example:
        >>> backbone = kbert.BertBackbone(100, 1, 2, 16, 32, max_sequence_length=32)
        >>> model = BertSeq2SeqLM(backbone, start_token_id=2, end_token_id=3)
        >>> x = {"encoder_token_ids": np.array([[2, 7, 9, 3]]),
        ...      "encoder_padding_mask": np.ones((1, 4), "int32")}
        >>> ids = model.generate(x, max_length=6)
        >>> int(ids[0, 0]), ids.shape[1] <= 6
        (2, True)
        """
        strategy, options = decoding_options(
            num_beams, do_sample, temperature, top_k, top_p, seed, length_penalty, early_stopping
        )
        texts = not isinstance(inputs, dict)
        if texts:
            x = self._source_ids(inputs)
        else:
            missing = [k for k in INPUT_NAMES[:2] if k not in inputs]
            if missing:
                raise ValueError(
                    f"generate takes raw strings or a dict with encoder_token_ids and "
                    f"encoder_padding_mask; the dict lacks {missing}"
                )
            x = {k: np.asarray(inputs[k]) for k in INPUT_NAMES[:2]}
        self._check_generation(x, max_length)
        ids = generate_ids(
            self,
            x["encoder_token_ids"],
            x["encoder_padding_mask"],
            max_length,
            strategy,
            options,
            batch_size=batch_size,
            max_source_length=self.backbone.max_sequence_length
            - (max_length if self.architecture == "unilm" else 0),
        )
        if not texts:
            return ids
        return [self._output_text(row) for row in ids]

    def _source_ids(self, texts):
        if self.preprocessor is None:
            raise ValueError(
                "generate on raw strings needs a preprocessor: attach one "
                "(model.preprocessor = kbert.BertPreprocessor(...)) or pass encoder ids"
            )
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        empty = [i for i, t in enumerate(texts) if isinstance(t, str) and not t.strip()]
        if empty:
            raise ValueError(
                f"source texts {empty[:5]} are empty: there is nothing to generate from"
            )
        packed = self.preprocessor(texts)
        return {
            "encoder_token_ids": np.asarray(packed["token_ids"], "int32"),
            "encoder_padding_mask": np.asarray(packed["padding_mask"], "int32"),
        }

    def _output_text(self, row):
        tokens = [int(t) for t in row[1:]]
        if self.end_token_id in tokens:
            tokens = tokens[: tokens.index(self.end_token_id)]
        return self.preprocessor.tokenizer.detokenize([t for t in tokens if t != self.pad_token_id])

    def _check_generation(self, x, max_length):
        for name in ("start_token_id", "end_token_id"):
            if getattr(self, name) is None:
                raise ValueError(
                    f"{name} is not set (the model has no preprocessor whose "
                    f"{'[CLS]' if name == 'start_token_id' else '[SEP]'} it defaults to); "
                    f"build the model with {name}=<id> or with a preprocessor"
                )
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
            raise ValueError(
                f"max_length must be an int >= 1 (the start token counts as 1), got {max_length!r}"
            )
        limit = (self.decoder_config or self.backbone.get_config())["max_sequence_length"]
        if self.architecture != "unilm" and max_length > limit:
            raise ValueError(
                f"max_length={max_length} exceeds the decoder's {limit} positions; "
                f"use max_length <= {limit}"
            )
        ids, mask = x["encoder_token_ids"], x["encoder_padding_mask"]
        if ids.ndim != 2 or ids.shape != mask.shape:
            raise ValueError(
                f"encoder_token_ids {ids.shape} and encoder_padding_mask {mask.shape} must "
                "be (batch, length) alike"
            )
        empty = np.flatnonzero(ids.shape[1] == 0 or ~np.any(mask != 0, axis=1))
        if len(empty):
            raise ValueError(
                f"rows {empty[:5].tolist()} have no source token (padding mask all 0): "
                "there is nothing to generate from"
            )
        if self.architecture == "unilm" and ids.shape[1] + max_length > limit:
            raise ValueError(
                f"a unilm row holds the source and the output: {ids.shape[1]} source tokens "
                f"+ max_length={max_length} exceed max_sequence_length={limit}"
            )
        checks.check_token_ids(ids, self.backbone.vocabulary_size, "encoder_token_ids")

    # --- cached decoding (`kbert.generation.runner`) -----------------------

    def generation_start(self, encoder_token_ids, encoder_padding_mask, max_length, num_beams=1):
        """(constants, cache) after reading the source: the cache holds
        per-layer key/value tensors for `max_length` decoder tokens (after
        the source's, for "unilm"), `num_beams` rows per source (its beams
        adjacent); the constants, the cross-attention keys and values of the
        encoder output, one row per source (a step's cross-attention takes
        a source's beams as its queries), or the source lengths."""
        if self.architecture == "unilm":
            constants, cache = self._unilm_start(
                encoder_token_ids, encoder_padding_mask, max_length
            )
            if num_beams > 1:
                cache = keras.tree.map_structure(lambda t: ops.repeat(t, num_beams, axis=0), cache)
                constants["source_lengths"] = ops.repeat(
                    constants["source_lengths"], num_beams, axis=0
                )
            return constants, cache
        dtype = self.decoder_embeddings.compute_dtype
        batch = ops.shape(encoder_token_ids)[0] * num_beams
        encoded = self.backbone(
            {
                "token_ids": encoder_token_ids,
                "segment_ids": ops.zeros_like(encoder_token_ids),
                "padding_mask": encoder_padding_mask,
            },
            training=False,
        )["sequence_output"]
        constants = {"encoder_padding_mask": encoder_padding_mask, "cross": []}
        cache = {"keys": [], "values": []}
        for block in self.decoder_blocks:
            constants["cross"].append(block.cross_key_values(encoded))
            heads, size = block.self_attention.num_heads, block.self_attention.head_dim
            cache["keys"].append(ops.zeros((batch, max_length, heads, size), dtype))
            cache["values"].append(ops.zeros((batch, max_length, heads, size), dtype))
        cache["key_mask"] = ops.zeros((batch, max_length), "int32")
        return constants, cache

    def _unilm_start(self, encoder_token_ids, encoder_padding_mask, max_length):
        # The source's keys and values at every layer fill the first S
        # cache positions; the target's follow.
        embeddings = self.decoder_embeddings
        dtype = embeddings.compute_dtype
        batch, length = ops.shape(encoder_token_ids)[0], ops.shape(encoder_token_ids)[1]
        padding = ops.cast(encoder_padding_mask, "int32")
        positions = ops.maximum(ops.cumsum(padding, axis=1) - 1, 0)
        x = embeddings(encoder_token_ids, ops.zeros_like(encoder_token_ids), position_ids=positions)
        key_mask = ops.concatenate([padding, ops.zeros((batch, max_length), "int32")], axis=1)
        cache = {"keys": [], "values": [], "key_mask": key_mask}
        for block in self.decoder_blocks:
            heads, size = block.self_attention.num_heads, block.self_attention.head_dim
            zeros = ops.zeros((batch, length + max_length, heads, size), dtype)
            x, keys, values = block_call_cached(block, x, zeros, zeros, 0, key_mask)
            cache["keys"].append(keys)
            cache["values"].append(values)
        constants = {"source_lengths": ops.sum(padding, axis=1), "offset": length}
        return constants, cache

    def generation_step(self, constants, cache, token_ids, index):
        """Logits (B, V) for the token after `token_ids` (B, 1), the decoder
        token at position `index` (a scalar), and the cache with its keys
        and values written."""
        unilm = self.architecture == "unilm"
        slot = index + constants["offset"] if unilm else index
        batch = ops.shape(token_ids)[0]
        key_mask = cache_write(cache["key_mask"], slot, ops.ones((batch, 1), "int32"))
        if unilm:
            positions = ops.reshape(constants["source_lengths"] + index, (batch, 1))
            segments = ops.ones_like(token_ids)
        else:
            positions = ops.zeros_like(token_ids) + index
            segments = ops.zeros_like(token_ids)
        # sublayer_call: each step calls the layers on one token, where Keras'
        # per-call bookkeeping on torch would cost more than the arithmetic
        x = sublayer_call(self.decoder_embeddings, token_ids, segments, position_ids=positions)
        keys, values = [], []
        for i, block in enumerate(self.decoder_blocks):
            cross = None if unilm else (*constants["cross"][i], constants["encoder_padding_mask"])
            x, k, v = block_call_cached(
                block, x, cache["keys"][i], cache["values"][i], slot, key_mask, cross
            )
            keys.append(k)
            values.append(v)
        logits = sublayer_call(self.lm_head, x)[:, 0]  # (B, V)
        return logits, {"keys": keys, "values": values, "key_mask": key_mask}

    def generation_reorder(self, cache, rows):
        """The cache with its rows taken in the order `rows` (beam search)."""
        return {
            k: [ops.take(t, rows, axis=0) for t in v]
            if isinstance(v, list)
            else ops.take(v, rows, axis=0)
            for k, v in cache.items()
        }

    # --- construction -----------------------------------------------------

    @classmethod
    def from_preset(cls, preset, load_weights=True, architecture=None, decoder=_SAME, **kwargs):
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
            kwargs["decoder_config"] = {key: decoder.get_config()[key] for key in DECODER_KEYS}
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

    def prefix(layer, variable):
        own = layer.name + "/"
        return variable.path[len(own) :] if variable.path.startswith(own) else variable.path

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
            # through the host: on JAX an assigned variable would share the
            # source's buffer, which a training step donates twice
            variable.assign(ops.convert_to_numpy(held[path]))
            copied.append(path)
    return copied
