"""Training and evaluation: block-local losses, the trainer, checkpoints, quality metrics."""

from blocktrain.training.checkpoint import load_model, read_config
from blocktrain.training.evaluate import (
    EvalSettings,
    evaluate_blocktrain,
    evaluate_reference,
)
from blocktrain.training.loss import BlockLoss, reference_loss
from blocktrain.training.trainer import Trainer

__all__ = [
    "BlockLoss",
    "EvalSettings",
    "Trainer",
    "evaluate_blocktrain",
    "evaluate_reference",
    "load_model",
    "read_config",
    "reference_loss",
]
