from kbert.models.backbone import BertBackbone
from kbert.models.preprocessor import BertPreprocessor
from kbert.models.pretrainer import BertMaskedLM, BertPreTrainer
from kbert.models.task import Task

__all__ = ["BertBackbone", "BertMaskedLM", "BertPreprocessor", "BertPreTrainer", "Task"]
