"""BlockLoss against the loss written out by hand (docs/model.md; the block-local loss of the
BlockTrain design, section 2.5), on a stand-in block whose outputs depend on its inputs, so a wrong
noisy input, weight or target shows in the value."""

from __future__ import annotations

import dataclasses

import torch

from blocktrain.model import Reference, SigmaSchedule, target_table
from blocktrain.training import BlockLoss, reference_loss
from tests.conftest import micro_config

N, BLOCK, SEED = 3, 2, 5


class LinearBlock(torch.nn.Module):
    """Logits linear in the noisy input z, aux logits a lookup of the clean bytes; records what
    it was called with."""

    def __init__(self, d: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.to_logits = torch.randn(d, 256, generator=gen)  # (d, V)
        self.aux_table = torch.randn(256, 256, generator=gen)  # (V, V)
        self.calls: list[dict[str, object]] = []

    def forward(self, x_bytes, z, sigma, layout, *, with_aux, upstream=None):
        assert upstream is None  # route = state: the loss passes nothing from upstream
        self.calls.append({"z": z, "sigma": sigma, "with_aux": with_aux})
        return z @ self.to_logits, self.aux_table[x_bytes] if with_aux else None  # (N, T, V)


def hand_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits)[target] per position, in float64."""
    logits = logits.double()
    log_z = logits.logsumexp(-1)
    return log_z - logits.gather(-1, targets[..., None])[..., 0]


def block_loss(aux_weight: float, block_index: int):
    """BlockLoss of a LinearBlock on N random windows; returns what the hand version needs."""
    cfg = micro_config("state")  # a stand-in block: the route only adds what it reads
    model = dataclasses.replace(cfg.model, aux_weight=aux_weight)
    targets = target_table(cfg.seed, model.d_model)
    x = torch.randint(0, 256, (N, model.seq_len), generator=torch.Generator().manual_seed(1))
    block = LinearBlock(model.d_model)
    parts = BlockLoss(model, targets)(block, block_index, x, torch.Generator().manual_seed(SEED))
    (call,) = block.calls
    return model, targets, x, block, call, parts


def test_block_loss_equals_the_hand_written_loss():
    model, targets, x, block, call, parts = block_loss(0.5, BLOCK)

    # The same draws, in the loss's order: N sigmas from the block's training interval, then eps.
    gen = torch.Generator().manual_seed(SEED)
    schedule = SigmaSchedule.from_config(model)
    sigma = schedule.sample_training_sigma(BLOCK, N, gen)  # (N,)
    eps = torch.randn(N, model.seq_len, model.d_model, generator=gen)  # (N, T, d)
    assert call["with_aux"] is True, "aux_weight > 0 asks the block for the aux logits"
    assert torch.equal(call["sigma"], sigma), "sigma is drawn first from the loss's generator"
    # addcmul is one fused pass, the hand version two roundings: fp32 tolerance.
    torch.testing.assert_close(call["z"], targets[x] + sigma[:, None, None] * eps)
    lo, hi = schedule.training_interval(BLOCK)
    assert all(lo <= s <= hi for s in sigma.tolist()), "sigma within block 2's training interval"

    sd = model.sigma_data_value
    s = sigma.double()
    weight = (s**2 + sd**2) / (s * sd) ** 2 * sd**2  # EDM w(sigma), normalised by sd^2
    ce = hand_ce(call["z"] @ block.to_logits, x)  # (N, T)
    aux_ce = hand_ce(block.aux_table[x[:, :-1]], x[:, 1:]).mean()  # predicts the next byte
    total = (weight[:, None] * ce).mean() + 0.5 * aux_ce

    # float32 loss against a float64 hand computation: relative error ~1e-6 from the sums.
    torch.testing.assert_close(parts.total.double(), total, rtol=1e-5, atol=0)
    assert abs(parts.logs["loss"] - float(total)) < 1e-5 * float(total)
    assert abs(parts.logs["loss_denoise"] - float(ce.mean())) < 1e-5 * float(ce.mean())
    assert abs(parts.logs["loss_aux"] - float(aux_ce)) < 1e-5 * float(aux_ce)


def test_without_aux_the_loss_is_the_weighted_denoising_ce():
    model, _, x, block, call, parts = block_loss(0.0, 0)
    assert call["with_aux"] is False and "loss_aux" not in parts.logs
    s, sd = call["sigma"].double(), model.sigma_data_value
    ce = hand_ce(call["z"] @ block.to_logits, x)
    total = ((1 + sd**2 / s**2)[:, None] * ce).mean()
    torch.testing.assert_close(parts.total.double(), total, rtol=1e-5, atol=0)


def test_reference_loss_is_the_next_byte_ce():
    cfg = micro_config("state")  # a stand-in block: the route only adds what it reads
    model = Reference(cfg.model)
    x = torch.randint(0, 256, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(x)  # (N, T, V): position t predicts byte t + 1
        parts = reference_loss(model, x)
    want = hand_ce(logits[:, :-1], x[:, 1:]).mean()
    torch.testing.assert_close(parts.total.double(), want, rtol=1e-5, atol=0)
