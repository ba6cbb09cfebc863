from kbert.models.backbone import BertBackbone
from kbert.models.pretrainer import BertMaskedLM, BertPreTrainer
from kbert.models.task import Task

__all__ = ["BertBackbone", "BertMaskedLM", "BertPreTrainer", "Task"]
