from kbert.models.backbone import BertBackbone

__all__ = ["BertBackbone"]
