"""White-box attackers of the effect probe (simulate/attacks/probed.py): each push they make
passes their own copy of the probe, which is the aggregator's."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from blocktrain.data import load_split
from blocktrain.protocol.core.bounds import derived_settings, largest_block
from blocktrain.simulate.attacks.forge import AT_BOUND, BIAS_TENSOR, norm
from blocktrain.simulate.attacks.probed import DRIFT_SHARE, AscendTrainer, DriftTrainer
from blocktrain.training.local import initial_blocks, local_trainer
from blocktrain.training.probe import BlockProbe
from tests.conftest import micro_config

CFG = micro_config("features")
BLOCK = 2


@pytest.fixture
def setup(corpus: Path):
    """The pulled weights of BLOCK after a few honest steps (a block past its zero head), the
    blocks it reads, the run's norm bound and a probe as the aggregator builds it."""
    train, valid = load_split(corpus, "train"), load_split(corpus, "valid")
    initial = initial_blocks(CFG)
    others = {b: initial[b] for b in range(BLOCK)}
    warm = local_trainer(CFG, "block", BLOCK, train, data_seed=1)
    warm.load(initial[BLOCK])
    warm.load_upstream(others)
    warm.train(4, 0)
    pulled = {k: v.detach().clone() for k, v in warm.module.state_dict().items()}
    bound = derived_settings(CFG, {"local_steps": 2}, largest_block(initial)).max_delta_norm
    return train, pulled, others, bound, BlockProbe(CFG, valid, skip_bytes=512)


def loaded(trainer, pulled, others):
    trainer.load(pulled)
    trainer.load_upstream(others)
    return trainer


def test_drift_adds_the_largest_bias_its_probe_still_passes(setup) -> None:
    train, pulled, others, bound, probe = setup
    drift = loaded(
        DriftTrainer(local_trainer(CFG, "block", BLOCK, train, data_seed=7), probe, bound),
        pulled,
        others,
    )
    logs = drift.train(2, 8)
    assert logs["steps"] == 2 and logs["tokens"] > 0, "it trains honestly"
    delta = drift.delta()
    honest = {k: DRIFT_SHARE * v for k, v in drift.inner.delta().items()}
    bias = float(delta[BIAS_TENSOR][0] - honest[BIAS_TENSOR][0])
    assert bias > 0
    rest = delta[BIAS_TENSOR].clone()
    rest[0] = honest[BIAS_TENSOR][0]
    assert torch.allclose(rest, honest[BIAS_TENSOR]), "the bias is on byte 0 alone"
    assert norm(delta) <= AT_BOUND * bound * (1 + 1e-6)
    before = probe.loss(BLOCK, pulled, others)

    def after(extra: float) -> float:
        weights = {k: w + delta[k] for k, w in pulled.items()}
        weights[BIAS_TENSOR][0] += extra
        return probe.loss(BLOCK, weights, others)

    assert after(0.0) < before, "its push passes the probe"
    d0, b = float(honest[BIAS_TENSOR][0]), AT_BOUND * bound
    room = -d0 + math.sqrt(d0 * d0 - norm(honest) ** 2 + b * b)  # what the bound leaves
    assert bias == pytest.approx(room) or after(room / 32) >= before, "the largest that passes"


class QuadraticProbe:
    """A probe whose loss is (head.bias[0] - 1)^2: it falls for a bias in (0, 2)."""

    def window_losses(self, block, weights, others=None, draw=0) -> torch.Tensor:
        return ((weights[BIAS_TENSOR][:1] - 1.0) ** 2).float()  # one window

    def gradient(self, block, weights, others=None, draw=0) -> dict[str, torch.Tensor]:
        out = {k: torch.zeros_like(w) for k, w in weights.items()}
        out[BIAS_TENSOR][0] = 2 * (weights[BIAS_TENSOR][0] - 1.0)
        return out


def test_the_drift_bias_is_found_by_bisection_within_the_bound() -> None:
    inner = SimpleNamespace(
        block_index=0,
        upstream_blocks=[],
        load=lambda _weights: None,
        cfg=CFG,
        relays_from=None,
        relays_to=None,
        load_stream=None,
        stream_out=None,
    )
    drift = DriftTrainer(inner, QuadraticProbe(), bound=10.0 / AT_BOUND)  # type: ignore[arg-type]
    drift.load({BIAS_TENSOR: torch.zeros(4), "w": torch.zeros(3)})
    delta = {BIAS_TENSOR: torch.tensor([0.1, 0.0, 0.0, 0.0]), "w": torch.zeros(3)}
    bias = drift.largest_bias(delta)
    assert 1.9 - 10.0 / 64 <= bias < 1.9, "falls up to 0.1 + b = 2, within 1/64 of the room"
    assert drift.largest_bias({**delta, "w": torch.tensor([0.0, 0.0, 9.99])}) < 0.5, "the bound"
    assert drift.largest_bias({**delta, BIAS_TENSOR: torch.full((4,), -0.5)}) == 0.0, (
        "a delta that raises the loss alone carries no bias"
    )


def test_ascend_sits_at_the_bound_and_its_probe_sees_a_fall(setup) -> None:
    train, pulled, others, bound, probe = setup

    def crafted(cls):
        t = loaded(
            cls(local_trainer(CFG, "block", BLOCK, train, data_seed=7), probe, bound, 99),
            pulled,
            others,
        )
        logs = t.train(2, 8)
        assert {k: logs[k] for k in ("tokens", "loss", "steps")} == {
            "tokens": 99.0,
            "loss": pytest.approx(math.nan, nan_ok=True),
            "steps": 2.0,
        }
        reports.append(logs)
        return t.delta()

    reports: list[dict[str, float]] = []
    delta = crafted(AscendTrainer)
    assert 0.0 < reports[0]["ascent_share"] <= 1.0
    assert all(math.isfinite(reports[0][f"fresh_loss_{at}"]) for at in ("at_probe_step", "after"))
    assert norm(delta) == pytest.approx(AT_BOUND * bound, rel=1e-4)
    before = probe.loss(BLOCK, pulled, others)
    assert probe.loss(BLOCK, {k: w + delta[k] for k, w in pulled.items()}, others) < before

    class FitOnly(AscendTrainer):
        def largest(self, deviate, hi):  # no ascent: the probe-fitting part at the bound
            return 0.0

    fit = crafted(FitOnly)
    x = train.windows(CFG.model.seq_len, 64 * CFG.model.seq_len)
    losses = []
    for d in (delta, fit):
        t = local_trainer(CFG, "block", BLOCK, train, data_seed=0)
        t.load({k: w + d[k] for k, w in pulled.items()})
        t.load_upstream(others)
        with torch.no_grad():
            losses.append(float(t.objective(x, torch.Generator().manual_seed(5)).total))
    assert losses[0] > losses[1], "the ascent raises the training text's loss"
    fit_only = reports[1]
    assert fit_only["ascent_share"] == 0.0
    rise = [r["fresh_loss_after"] - r["fresh_loss_before"] for r in reports]
    assert rise[0] > rise[1], "what it reports of a fresh batch sees the ascent too"
