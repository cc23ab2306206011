"""Training losses, in the style of NVlabs/edm's loss.py: small callables that own sigma sampling
and weighting and take the network as an argument."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blocktrain.config import ModelConfig
from blocktrain.model import Block, Reference, SigmaSchedule, ZLayout, loss_weight

# What block b reads from the blocks before it (BlockStack.upstream): (b, x_bytes) -> features.
Upstream = Callable[[int, torch.Tensor], torch.Tensor | None]


@dataclass
class LossParts:
    """The scalar to minimise and what to log about it."""

    total: torch.Tensor
    logs: dict[str, float]
    rows: Callable[[], torch.Tensor] | None = None
    """Each sequence's share of `total`, (N,), for a paired test over the batch (the effect
    probe); computed on demand, so training pays nothing for it. Their mean is `total` up to
    float reassociation."""
    clean: torch.Tensor | None = None
    """Under `route = relay`, the block's clean-stream output on the batch (N, T, d), detached:
    what its replica relays to the next block (None for the last block and other routes)."""


# (total, logs, aux logits, per-row losses, the relayed clean output): a loss's parts.
_Parts = tuple[
    torch.Tensor,
    dict[str, float],
    torch.Tensor | None,
    Callable[[], torch.Tensor],
    torch.Tensor | None,
]


class BlockLoss:
    """The block-local loss of the BlockTrain design (section 2.5):

        L_b = E_sigma~block b's interval [ w(sigma) * CE(block(x, E[y] + sigma * eps, sigma), y) ]
              + aux_weight * CE(clean-stream next-byte logits)

    Only block b's parameters receive gradients; nothing here touches another block."""

    def __init__(
        self, cfg: ModelConfig, targets: torch.Tensor, upstream: Upstream | None = None
    ) -> None:
        self.cfg = cfg
        self.targets = targets
        self.upstream = upstream
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
        want_aux = self.cfg.aux_weight > 0
        total, logs, aux, rows, clean = self._gaussian(block, index, x_bytes, generator, want_aux)
        if aux is not None:
            aux_logits, next_bytes = aux[:, :-1].float(), x_bytes[:, 1:]
            aux_ce = F.cross_entropy(aux_logits.flatten(0, 1), next_bytes.flatten())
            total = total + self.cfg.aux_weight * aux_ce
            logs["loss_aux"] = float(aux_ce.detach())
            denoise_rows = rows

            def rows() -> torch.Tensor:
                per_byte = F.cross_entropy(aux_logits.transpose(1, 2), next_bytes, reduction="none")
                return denoise_rows() + self.cfg.aux_weight * per_byte.mean(dim=1)

        logs["loss"] = float(total.detach())
        return LossParts(total, logs, rows, clean)

    def _forward(
        self,
        block: Block,
        index: int,
        x_bytes: torch.Tensor,
        z: torch.Tensor,
        sigma: torch.Tensor,
        want_aux: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The block's forward pass on what it reads upstream: (logits, aux logits, and under
        `route = relay` but for the last block its clean output, detached, for the replica to
        relay: `LossParts.clean`)."""
        upstream = None if self.upstream is None else self.upstream(index, x_bytes)
        layout = self.layout(x_bytes.device)
        if self.cfg.route != "relay" or index == self.cfg.blocks - 1:
            return (*block(x_bytes, z, sigma, layout, with_aux=want_aux, upstream=upstream), None)
        logits, aux, clean = block.forward_with_clean(
            x_bytes, z, sigma, layout, with_aux=want_aux, upstream=upstream
        )
        return logits, aux, clean.detach()

    def _gaussian(
        self,
        block: Block,
        index: int,
        x_bytes: torch.Tensor,
        generator: torch.Generator,
        want_aux: bool,
    ) -> _Parts:
        n, t = x_bytes.shape
        device = x_bytes.device
        sigma = self.schedule.sample_training_sigma(index, n, generator)  # (N,)
        eps = torch.randn(n, t, self.cfg.d_model, generator=generator, device=device)
        z = torch.addcmul(self.targets[x_bytes], sigma[:, None, None], eps)  # (N, T, d)
        logits, aux, clean = self._forward(block, index, x_bytes, z, sigma, want_aux)
        ce = F.cross_entropy(
            logits.float().flatten(0, 1), x_bytes.flatten(), reduction="none"
        ).view(n, t)
        weighted = loss_weight(sigma, self.cfg.sigma_data_value)[:, None] * ce  # (N, T)
        logs = {"loss_denoise": float(ce.detach().mean())}
        return weighted.mean(), logs, aux, lambda: weighted.mean(dim=1), clean


def reference_loss(model: Reference, x_bytes: torch.Tensor) -> LossParts:
    """Next-byte cross-entropy of the end-to-end reference."""
    logits = model(x_bytes)
    ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), x_bytes[:, 1:].flatten())
    return LossParts(ce, {"loss": float(ce.detach())})
