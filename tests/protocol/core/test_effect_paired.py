"""The effect probe's paired test: an update's effect is read window by window on the same
bytes, sigmas and noise, and its standard error comes from the spread of those paired changes,
so the acceptance threshold (`probe_z` standard errors) is the update's own, not its peers'."""

from __future__ import annotations

import math

import pytest
import torch

from blocktrain.protocol.core.effect import Effect, ProbeCache, judge_effect
from blocktrain.protocol.core.settings import AggregatorSettings


def test_the_standard_error_is_that_of_the_paired_changes_not_of_the_losses():
    before = torch.tensor([1.0, 2.0, 3.0, 4.0])  # windows differ a lot from one another
    after = before + torch.tensor([0.01, 0.03, 0.01, 0.03])  # each moves by a little
    effect = Effect.paired(before, after)
    assert effect.before == pytest.approx(2.5)
    assert effect.relative == pytest.approx(0.02 / 2.5, rel=1e-4)  # float32 inputs
    changes = torch.tensor([0.01, 0.03, 0.01, 0.03], dtype=torch.float64) / 2.5
    assert effect.stderr == pytest.approx(float(changes.std()) / math.sqrt(4), rel=1e-4)
    assert effect.stderr < 0.1 * float(before.std()) / 2.5, "the losses' own spread cancels"


def test_one_window_has_no_spread():
    assert Effect.paired(torch.tensor([2.0]), torch.tensor([2.5])).stderr == 0.0


@pytest.mark.parametrize(
    ("relative", "stderr", "z", "accepted"),
    [
        (-0.01, 0.001, 0.0, True),  # a fall is always accepted
        (+0.001, 0.001, 0.0, False),  # z = 0: only a fall, as before the paired test
        (+0.001, 0.001, 2.0, True),  # a rise inside 2 of its standard errors
        (+0.003, 0.001, 2.0, False),  # a rise beyond them
        (0.0, 0.0, 2.0, False),  # nothing moved: no_gain, whatever z (a do-nothing vote)
    ],
)
def test_acceptance_threshold_is_z_of_the_updates_own_standard_errors(
    relative, stderr, z, accepted
):
    effect = Effect(1.0, 1.0 + relative, stderr)
    assert judge_effect(effect, 0.002, None, z).accepted is accepted


def test_a_rise_beyond_the_threshold_is_harmful_only_past_the_tolerance():
    assert judge_effect(Effect(1.0, 1.001, 0.0001), 0.002, None, 2.0).reason == "no_gain"
    assert judge_effect(Effect(1.0, 1.01, 0.0001), 0.002, None, 2.0).reason == "harmful"
    assert "±" in judge_effect(Effect(1.0, 1.01, 0.0001), 0.002, None, 2.0).detail


def test_nan_is_refused_harmful():
    assert judge_effect(Effect(1.0, math.nan, 0.01), 0.002, None, 2.0).reason == "harmful"


def test_probe_z_is_a_setting_with_a_range():
    assert AggregatorSettings().probe_z >= 0
    with pytest.raises(Exception, match="probe_z"):
        AggregatorSettings(probe_z=-1.0)


class DrawRecorder:
    """A probe whose loss is the weight's value on every window; it records the draws asked."""

    def __init__(self) -> None:
        self.draws: list[int] = []

    def window_losses(self, block, weights, others=None, draw=0):
        self.draws.append(draw)
        return weights["w"].float().expand(4).clone() + torch.arange(4.0)


def test_each_committed_version_is_read_on_a_new_draw_and_its_updates_on_the_same_one():
    probe = DrawRecorder()
    cache = ProbeCache(probe)
    v0, v1 = {"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}
    delta = {"w": torch.tensor([-0.4])}
    effect = cache.effect(0, v0, delta, {}, step=0.25)
    assert effect.after - effect.before == pytest.approx(-0.1), "a quarter of the update"
    cache.effect(0, v0, delta, {})
    assert probe.draws == [0, 0, 0], "before once, each after on the version's draw"
    cache.effect(0, v1, delta, {})  # a commit replaced the block's weights
    assert probe.draws[3:] == [1, 1]
