"""WordPiece tokenization with the reference BERT rules, vocabulary training,
and byte-level BPE (RoBERTa, Longformer) from a Hugging Face tokenizer.json."""

from kbert.tokenizers.bpe import ByteLevelBPETokenizer
from kbert.tokenizers.training import train_wordpiece_vocabulary
from kbert.tokenizers.vocabulary import SPECIAL_TOKENS, load_vocabulary
from kbert.tokenizers.wordpiece import BertTokenizer, truncate_pair

__all__ = [
    "BertTokenizer",
    "ByteLevelBPETokenizer",
    "SPECIAL_TOKENS",
    "load_vocabulary",
    "train_wordpiece_vocabulary",
    "truncate_pair",
]
