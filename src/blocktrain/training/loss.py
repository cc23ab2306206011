"""Training losses, in the style of NVlabs/edm's loss.py: small callables that own sigma sampling
and weighting and take the network as an argument."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blocktrain.config import ModelConfig
from blocktrain.model import Block, Reference, SigmaSchedule, ZLayout, loss_weight


@dataclass
class LossParts:
    """The scalar to minimise and what to log about it."""

    total: torch.Tensor
    logs: dict[str, float]


class BlockLoss:
    """The block-local loss of DESIGN.md 2.5:

        L_b = E_sigma~block b's interval [ w(sigma) * CE(block(x, E[y] + sigma * eps, sigma), y) ]
              + aux_weight * CE(clean-stream next-byte logits)

    Only block b's parameters receive gradients; nothing here touches another block."""

    def __init__(self, cfg: ModelConfig, targets: torch.Tensor) -> None:
        self.cfg = cfg
        self.targets = targets
        self.schedule = SigmaSchedule.from_config(cfg)
        self._layouts: dict[torch.device, ZLayout] = {}

    def layout(self, device: torch.device) -> ZLayout:
        if device not in self._layouts:
            self._layouts[device] = ZLayout.training(self.cfg.seq_len, self.cfg.span, device)
        return self._layouts[device]

    def __call__(
        self, block: Block, index: int, x_bytes: torch.Tensor, generator: torch.Generator
    ) -> LossParts:
        """x_bytes (N, T) on the block's device; `generator` (same device) draws sigma and eps."""
        n, t = x_bytes.shape
        device = x_bytes.device
        sigma = self.schedule.sample_training_sigma(index, n, generator)  # (N,)
        eps = torch.randn(n, t, self.cfg.d_model, generator=generator, device=device)
        z = torch.addcmul(self.targets[x_bytes], sigma[:, None, None], eps)  # (N, T, d)
        want_aux = self.cfg.aux_weight > 0
        logits, aux = block(x_bytes, z, sigma, self.layout(device), with_aux=want_aux)
        ce = F.cross_entropy(
            logits.float().flatten(0, 1), x_bytes.flatten(), reduction="none"
        ).view(n, t)
        weight = loss_weight(sigma, self.cfg.sigma_data_value)  # (N,)
        total = (weight[:, None] * ce).mean()
        logs = {"loss_denoise": float(ce.detach().mean())}
        if aux is not None:
            aux_ce = F.cross_entropy(aux[:, :-1].float().flatten(0, 1), x_bytes[:, 1:].flatten())
            total = total + self.cfg.aux_weight * aux_ce
            logs["loss_aux"] = float(aux_ce.detach())
        logs["loss"] = float(total.detach())
        return LossParts(total, logs)


def reference_loss(model: Reference, x_bytes: torch.Tensor) -> LossParts:
    """Next-byte cross-entropy of the end-to-end reference."""
    logits = model(x_bytes)
    ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), x_bytes[:, 1:].flatten())
    return LossParts(ce, {"loss": float(ce.detach())})
