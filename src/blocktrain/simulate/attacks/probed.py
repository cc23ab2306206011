"""White-box attackers of the effect probe (`drift`, `ascend`; docs/simulate.md, "Attackers").

The probe is public: its slice of the validation split, its sigmas and its noise follow from the
run's config and data, so an attacker rebuilds it (`training.probe.BlockProbe`, without the
aggregator's secret: the public slice) and sizes its update to the largest deviation its copy
still accepts under the published single-round rule (`judge_effect` at the aggregator's
`probe_step`, `probe_z`, `probe_gain_z`), by bisection (`_Probed.largest`).

`drift` biases byte 0's logit (`head.bias[0]`: byte 0 never occurs in text, so all of that bias
is harm). `ascend` overfits the probe's windows and adds a step up the training loss with its
component along the probe's gradient removed: a straight step across the probe's gradient leaves
only the first order (at tiny, a third of the bound raised the probe's loss by 11 nats), so the
ascent is as long as the probe allows and the fit fills the rest of the bound."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from blocktrain.protocol.core.effect import Effect, judge_effect
from blocktrain.simulate.attacks.forge import AT_BOUND, BIAS_TENSOR, Tensors, norm
from blocktrain.training.local import LocalBlockTrainer
from blocktrain.training.optim import make_optimizer, set_learning_rate
from blocktrain.training.probe import BlockProbe
from blocktrain.training.step import stream_seed

DRIFT_SHARE = 0.9
BISECTIONS = 6  # probe calls after the two at its ends: within 1/64 of the range
_ASCENT_SALT = 11
_FRESH_SALT = 13


def _dot(a: Tensors, b: Tensors) -> float:
    return sum(float((a[k].float() * b[k].float()).sum()) for k in a)


class _Probed:
    """A `LocalTrainer` around a `LocalBlockTrainer`, holding what its probe calls need: the
    weights it pulled and the upstream blocks it read with them."""

    def __init__(
        self,
        inner: LocalBlockTrainer,
        probe: BlockProbe,
        bound: float,
        step: float = 1.0,
        z: float = 0.0,
        gain_z: float = 0.0,
    ) -> None:
        self.inner = inner
        self.probe = probe
        self.bound = AT_BOUND * bound
        # the aggregator's published probe_step, probe_z and probe_gain_z
        self.step, self.z, self.gain_z = step, z, gain_z
        # its probe copy judges as the aggregator's does, with the blocks before it: it reads
        # them as a features worker does even where an honest replica needs only a stream
        reads = inner.cfg.model.reads_upstream
        self.upstream_blocks = list(range(inner.block_index)) if reads else []
        # route = relay: it takes and relays streams through its honest trainer
        self.relays_from, self.relays_to = inner.relays_from, inner.relays_to
        self.load_stream, self.stream_out = inner.load_stream, inner.stream_out
        self.base: Tensors = {}
        self.others: dict[int, Tensors] = {}

    def load(self, weights: Tensors) -> None:
        self.inner.load(weights)
        self.base = {k: v.float() for k, v in weights.items()}

    def load_upstream(self, blocks: dict[int, Tensors]) -> None:
        if self.inner.upstream_blocks:
            self.inner.load_upstream(blocks)
        self.others = blocks

    def largest(self, deviate: Callable[[float], Tensors], hi: float) -> float:
        """The largest size in [0, hi] whose delta `deviate(size)` the probe copy still accepts
        from the pulled weights (the aggregator's verdict on the public slice, unless the block
        moved since the pull), by bisection; 0 when even size 0 is not."""
        block = self.inner.block_index
        before = self.probe.window_losses(block, self.base, self.others)
        gradient = self.probe.gradient(block, self.base, self.others)

        def falls(size: float) -> bool:
            delta = deviate(size)
            after = {k: w + self.step * delta[k] for k, w in self.base.items()}
            losses = self.probe.window_losses(block, after, self.others)
            effect = Effect.read(before, losses, gradient, delta, self.step)
            return judge_effect(effect, 0.0, None, self.z, self.gain_z).accepted

        lo = 0.0
        if hi <= 0.0 or not falls(lo):
            return 0.0
        if falls(hi):
            return hi
        for _ in range(BISECTIONS):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if falls(mid) else (lo, mid)
        return lo


class DriftTrainer(_Probed):
    """`drift`: an honest `LocalBlockTrainer` whose delta carries a bias."""

    def train(
        self, steps: int, first_step: int, should_stop: Callable[[], bool] = lambda: False
    ) -> dict[str, float]:
        return self.inner.train(steps, first_step, should_stop)

    def delta(self) -> Tensors:
        honest = {k: DRIFT_SHARE * v for k, v in self.inner.delta().items()}
        return _with_bias(honest, self.largest_bias(honest))

    def largest_bias(self, delta: Tensors) -> float:
        """The largest bias on the target that `delta` can carry within the bound while the
        probe still sees the loss fall; 0 when even `delta` alone does not lower it."""
        # the room the bound leaves: |delta + b x e_target| <= bound
        d0 = float(delta[BIAS_TENSOR].view(-1)[0])
        disc = d0 * d0 - norm(delta) ** 2 + self.bound**2
        room = -d0 + math.sqrt(disc) if disc >= 0 else 0.0
        return self.largest(lambda bias: _with_bias(delta, bias), room)


def _with_bias(delta: Tensors, bias: float) -> Tensors:
    """`delta` with `bias` added to the target coordinate (a new dict and target tensor)."""
    target = delta[BIAS_TENSOR].clone()
    target.view(-1)[0] += bias
    return {**delta, BIAS_TENSOR: target}


class AscendTrainer(_Probed):
    """`ascend`: crafted on a `LocalBlockTrainer`'s module and the run's training data,
    claiming the largest token count the aggregator accepts, as a forger does."""

    def __init__(
        self,
        inner: LocalBlockTrainer,
        probe: BlockProbe,
        bound: float,
        tokens: int,
        step: float = 1.0,
        z: float = 0.0,
        gain_z: float = 0.0,
    ) -> None:
        super().__init__(inner, probe, bound, step, z, gain_z)
        self.tokens = tokens
        self._delta: Tensors = {}

    def train(
        self, steps: int, first_step: int, should_stop: Callable[[], bool] = lambda: False
    ) -> dict[str, float]:
        inner, cfg, probe = self.inner, self.inner.cfg, self.probe
        block = inner.block_index
        inner.module.train()
        optimizer = make_optimizer(inner.module, cfg.train)  # fresh: a few steps to overfit
        set_learning_rate(optimizer, cfg.train.lr)  # the peak rate, whatever the schedule
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            inner.objective(probe.x, probe.noise(block)).total.backward()
            optimizer.step()
        fit = inner.delta()
        # both gradients at the fitted weights, where the ascent starts
        probe_grad = self._grad(probe.x, probe.noise(block))
        batch, noise = (
            torch.Generator().manual_seed(stream_seed(inner.data_seed, block, first_step, salt))
            for salt in (_ASCENT_SALT, _ASCENT_SALT + 1)
        )
        x = inner.data.sample(cfg.train.batch_size, cfg.model.seq_len, batch)
        train_grad = self._grad(x, noise)
        along = _dot(train_grad, probe_grad) / max(_dot(probe_grad, probe_grad), 1e-30)
        up = {k: g - along * probe_grad[k] for k, g in train_grad.items()}
        unit = {k: v / max(norm(up), 1e-30) for k, v in up.items()}
        fu, ff = _dot(fit, unit), max(_dot(fit, fit), 1e-30)

        def at_bound(ascent: float) -> Tensors:
            """c x fit + ascent x unit, with c >= 0 the scale that puts it at the bound."""
            disc = (ascent * fu) ** 2 - ff * (ascent * ascent - self.bound**2)
            c = (-ascent * fu + math.sqrt(max(disc, 0.0))) / ff
            return {k: c * fit[k] + ascent * unit[k] for k in fit}

        ascent = self.largest(at_bound, self.bound)
        self._delta = at_bound(ascent)
        before, at_probe_step, after = self._fresh_losses(first_step, (0.0, self.step, 1.0))
        return {
            "tokens": float(self.tokens),
            "loss": math.nan,
            "steps": float(steps),
            "ascent_share": ascent / self.bound,
            "fresh_loss_before": before,
            "fresh_loss_at_probe_step": at_probe_step,
            "fresh_loss_after": after,
        }

    def _fresh_losses(self, first_step: int, steps: tuple[float, ...]) -> list[float]:
        """The block's training loss on a batch it did not craft with (the same bytes and noise
        each time), at the pulled weights plus each of `steps` times its delta: what the update
        does to the real objective, where the probe cannot see."""
        inner, cfg = self.inner, self.inner.cfg
        seeds = [
            stream_seed(inner.data_seed, inner.block_index, first_step, _FRESH_SALT + i)
            for i in (0, 1)
        ]
        x = inner.data.sample(
            cfg.train.batch_size, cfg.model.seq_len, torch.Generator().manual_seed(seeds[0])
        )
        losses = []
        inner.module.eval()
        for step in steps:
            inner.load({k: w + step * self._delta[k] for k, w in self.base.items()})
            with torch.no_grad():
                noise = torch.Generator().manual_seed(seeds[1])
                losses.append(float(inner.objective(x, noise).total))
        inner.load(self.base)
        return losses

    def _grad(self, x: torch.Tensor, noise: torch.Generator) -> Tensors:
        """The gradient of the block's loss on `x` with `noise`, by state-dict name."""
        module = self.inner.module
        module.zero_grad(set_to_none=True)
        self.inner.objective(x, noise).total.backward()
        grads = {k: p.grad for k, p in module.named_parameters() if p.grad is not None}
        return {
            k: grads[k].detach().clone() if k in grads else torch.zeros_like(v)
            for k, v in module.state_dict().items()
        }

    def delta(self) -> Tensors:
        return self._delta
