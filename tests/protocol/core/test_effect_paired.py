"""The effect probe's paired test: an update's effect is read window by window on the same
bytes, sigmas and noise, and its standard error comes from the spread of those paired changes,
so the acceptance threshold (`probe_z` standard errors) is the update's own, not its peers';
and its gain test: the first-order gain against what the delta's magnitudes gain by chance."""

from __future__ import annotations

import math

import pytest
import torch

from blocktrain.protocol.core.effect import Effect, ProbeCache, helped, judge_effect
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.core.verdict import Verdict


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
    gain, chance = (0.03, 0.001) if relative else (0.0, 0.0)  # a direction that gains
    effect = Effect(1.0, 1.0 + relative, stderr, gain, chance)
    assert judge_effect(effect, 0.002, None, z, 6.0).accepted is accepted


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

    def gradient(self, block, weights, others=None, draw=0):
        return {"w": torch.ones(1)}


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


# ---------------------------------------------------------------- the gain test (issue 58)


def test_the_gain_and_its_chance_come_from_the_gradient_and_the_delta():
    before, after = torch.tensor([2.0, 2.0]), torch.tensor([1.9, 1.7])
    gradient, delta = {"w": torch.tensor([1.0, -2.0])}, {"w": torch.tensor([-0.5, 0.5])}
    effect = Effect.read(before, after, gradient, delta, step=0.5)
    assert effect.gain == pytest.approx(0.5 * 1.5 / 2.0), "-step x g.delta / |before|"
    assert effect.chance == pytest.approx(0.5 * math.sqrt(0.25 + 1.0) / 2.0)
    assert effect.gain_z == pytest.approx(1.5 / math.sqrt(1.25))
    assert Effect.read(before, before, gradient, {"w": torch.zeros(2)}, 0.5).gain_z == 0.0


def test_noise_reads_as_a_standard_normal_against_its_chance_whatever_its_magnitudes():
    """The chance deviation is the spread of the gain over random signs of the delta's own
    magnitudes, so a delta whose signs are noise reads gain_z of mean 0 and deviation 1, with
    tails below exp(-t^2 / 2), however lopsided the gradient and the magnitudes are."""
    gen = torch.Generator().manual_seed(0)
    gradient = {"w": torch.randn(4096, generator=gen) ** 3}  # heavy-tailed, as a real one
    size = torch.rand(4096, generator=gen) ** 4
    reads = []
    for _ in range(2000):
        signs = torch.randint(2, (4096,), generator=gen) * 2.0 - 1.0
        effect = Effect.read(torch.ones(1), torch.ones(1), gradient, {"w": size * signs}, 1.0)
        reads.append(effect.gain_z)
    spread = torch.tensor(reads)
    assert abs(float(spread.mean())) < 0.1 and abs(float(spread.std()) - 1.0) < 0.1
    assert float((spread > 3).float().mean()) <= math.exp(-4.5), "Hoeffding's bound"
    assert float(spread.max()) < 6.0, "the default probe_gain_z"


@pytest.mark.parametrize(
    ("relative", "gain_z", "reason"),
    [
        (-0.01, 10.0, ""),  # a fall along a direction that gains: accepted
        (-0.01, 2.0, "no_gain"),  # a fall that chance explains (noise at the tiny preset)
        (+0.0005, 2.0, "no_gain"),  # a small rise, no gain: free
        (+0.05, 2.0, "harmful"),  # a large rise costs reputation whatever the gain test says
    ],
)
def test_an_update_is_accepted_only_when_its_gain_exceeds_chance(relative, gain_z, reason):
    effect = Effect(1.0, 1.0 + relative, 0.001, gain=gain_z * 0.001, chance=0.001)
    verdict = judge_effect(effect, 0.002, None, 1.0, 6.0)
    assert verdict.reason == reason, verdict
    assert reason == "" or "chance deviations" in verdict.detail


def test_reputation_rises_only_on_a_measured_gain():
    ok, fell, rose = Verdict.ok(), Effect(1.0, 0.99), Effect(1.0, 1.0001)
    assert helped(ok, fell) is True
    assert helped(ok, rose) is None, "a rise the paired test tolerates is no gain"
    assert helped(Verdict.refuse("no_gain"), fell) is None
    assert helped(Verdict.refuse("harmful"), rose) is False
    assert helped(Verdict.refuse("copy"), fell) is None
