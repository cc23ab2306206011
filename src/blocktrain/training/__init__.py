"""Training and evaluation: block-local losses, the trainer, checkpoints, quality metrics."""

from blocktrain.training.checkpoint import RunInfo, load_model, read_config
from blocktrain.training.evaluate import (
    EvalSettings,
    evaluate_blocktrain,
    evaluate_oracle_block,
    evaluate_reference,
)
from blocktrain.training.hub import from_pretrained, load_hf
from blocktrain.training.loss import BlockLoss, reference_loss
from blocktrain.training.trainer import Trainer

__all__ = [
    "BlockLoss",
    "EvalSettings",
    "RunInfo",
    "Trainer",
    "evaluate_blocktrain",
    "evaluate_oracle_block",
    "evaluate_reference",
    "from_pretrained",
    "load_hf",
    "load_model",
    "read_config",
    "reference_loss",
]
