"""Backend-agnostic BERT building blocks (keras + keras.ops only)."""

from kbert.layers import (
    banded_attention,  # noqa: F401  (registers "banded")
    flex_attention,  # noqa: F401  (registers "torch-flex")
)
from kbert.layers.activations import canonical_activation, get_activation
from kbert.layers.adapters import BottleneckAdapter, train_only_adapters
from kbert.layers.attention import MultiHeadSelfAttention
from kbert.layers.decoder import MultiHeadCrossAttention, TransformerDecoderBlock
from kbert.layers.dense import Dense
from kbert.layers.dropout import Dropout
from kbert.layers.embeddings import BertEmbeddings, TokenEmbedding
from kbert.layers.encoder import TransformerEncoderBlock
from kbert.layers.heads import MaskedLMHead, NextSentenceHead, Pooler
from kbert.layers.layer_norm import LayerNorm
from kbert.layers.masks import AttentionMask

__all__ = [
    "AttentionMask",
    "BertEmbeddings",
    "BottleneckAdapter",
    "Dense",
    "Dropout",
    "LayerNorm",
    "MaskedLMHead",
    "MultiHeadCrossAttention",
    "MultiHeadSelfAttention",
    "NextSentenceHead",
    "Pooler",
    "TokenEmbedding",
    "TransformerDecoderBlock",
    "TransformerEncoderBlock",
    "canonical_activation",
    "get_activation",
    "train_only_adapters",
]
