"""BlockTrain: train a byte-level language model as independently trainable diffusion blocks,
and serve the assembled model across hosts.

The public API is small on purpose (and locked by tests/test_public_api.py):

    from blocktrain import preset, apply_overrides, Trainer, load_model, load_split
    cfg = apply_overrides(preset("tiny"), ["steps=100"])
    Trainer.create(cfg, "runs/x", load_split(None, "train"), load_split(None, "valid")).run()

    model = blocktrain.from_pretrained("hf/tiny")  # a `blocktrain export --hf` folder
"""

from blocktrain.config import ModelConfig, RunConfig, TrainConfig, apply_overrides
from blocktrain.data import ByteCorpus, ByteSource, load_split
from blocktrain.errors import BlockTrainError, CheckpointError, ConfigError, DataError
from blocktrain.model import Block, BlockStack, Reference, Sampling, SigmaSchedule, generate
from blocktrain.presets import preset
from blocktrain.training import EvalSettings, Trainer, evaluate_blocktrain, load_model
from blocktrain.training.hub import from_pretrained

__version__ = "0.1.0"

__all__ = [
    "Block",
    "BlockStack",
    "BlockTrainError",
    "ByteCorpus",
    "ByteSource",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "EvalSettings",
    "ModelConfig",
    "Reference",
    "RunConfig",
    "Sampling",
    "SigmaSchedule",
    "TrainConfig",
    "Trainer",
    "__version__",
    "apply_overrides",
    "evaluate_blocktrain",
    "from_pretrained",
    "generate",
    "load_model",
    "load_split",
    "preset",
]
