from kbert.models.backbone import BertBackbone
from kbert.models.chunk_classifier import BertChunkClassifier
from kbert.models.classifier import BertClassifier
from kbert.models.distiller import BertDistiller
from kbert.models.memory_classifier import BertMemoryClassifier
from kbert.models.mobilebert import MobileBertBackbone
from kbert.models.multiple_choice import BertMultipleChoice
from kbert.models.preprocessor import BertPreprocessor
from kbert.models.pretrainer import BertMaskedLM, BertPreTrainer
from kbert.models.question_answerer import BertQuestionAnswerer
from kbert.models.seq2seq import BertSeq2SeqLM
from kbert.models.task import Task
from kbert.models.text_embedder import BertTextEmbedder
from kbert.models.token_classifier import BertTokenClassifier

__all__ = [
    "BertBackbone",
    "BertChunkClassifier",
    "BertClassifier",
    "BertDistiller",
    "BertMaskedLM",
    "BertMemoryClassifier",
    "BertMultipleChoice",
    "BertPreTrainer",
    "BertPreprocessor",
    "BertQuestionAnswerer",
    "BertSeq2SeqLM",
    "BertTextEmbedder",
    "BertTokenClassifier",
    "MobileBertBackbone",
    "Task",
]
