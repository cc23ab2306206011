"""Pure model math: noise levels, EDM scalings, the block, the reference and the sampler.
Imports only torch and the config; no I/O, no logging, no globals."""

from blocktrain.model.block import BOS, Block, ZLayout, target_table
from blocktrain.model.heads import head_logits
from blocktrain.model.reference import Reference, generate_autoregressive, init_reference
from blocktrain.model.sampler import Denoiser, euler_step, generate, one_sweep, stack_denoiser
from blocktrain.model.sampling import Sampling, sample_bytes
from blocktrain.model.sigma import EDMScalings, SigmaSchedule, edm_scalings, loss_weight
from blocktrain.model.stack import BlockStack, init_block

__all__ = [
    "BOS",
    "Block",
    "BlockStack",
    "Denoiser",
    "EDMScalings",
    "Reference",
    "Sampling",
    "SigmaSchedule",
    "ZLayout",
    "edm_scalings",
    "euler_step",
    "generate",
    "generate_autoregressive",
    "head_logits",
    "init_block",
    "init_reference",
    "loss_weight",
    "one_sweep",
    "sample_bytes",
    "stack_denoiser",
    "target_table",
]
