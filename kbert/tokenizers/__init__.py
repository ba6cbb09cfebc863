"""WordPiece tokenization with the reference BERT rules, and vocabulary training."""

from kbert.tokenizers.training import train_wordpiece_vocabulary
from kbert.tokenizers.vocabulary import SPECIAL_TOKENS, load_vocabulary
from kbert.tokenizers.wordpiece import BertTokenizer, truncate_pair

__all__ = [
    "BertTokenizer",
    "SPECIAL_TOKENS",
    "load_vocabulary",
    "train_wordpiece_vocabulary",
    "truncate_pair",
]
