import math

import pytest
import torch

from blocktrain.config import ModelConfig
from blocktrain.errors import ConfigError
from blocktrain.model import SigmaSchedule, edm_scalings, loss_weight


def schedule(**kw) -> SigmaSchedule:
    return SigmaSchedule.from_config(ModelConfig(**kw))


def test_boundaries_match_the_design_for_1_to_10_and_three_blocks():
    got = schedule(sigma_min=1.0, sigma_max=10.0, blocks=3, layers=3).boundaries()
    assert [round(b, 4) for b in got] == [1.0, 1.3436, 2.0711, 10.0], got


def test_intervals_have_equal_mass_and_block_zero_owns_the_highest():
    s = schedule(layers=4, blocks=4, sigma_min=0.5, sigma_max=20.0)
    masses = [s.cdf(hi) - s.cdf(lo) for lo, hi in (s.interval(b) for b in range(4))]
    assert max(masses) - min(masses) < 1e-9, masses
    assert s.interval(0)[1] == 20.0 and s.interval(3)[0] == 0.5


def test_training_interval_overlaps_by_gamma_and_clamps():
    s = schedule(overlap=0.1)
    lo, hi = s.interval(1)
    tlo, thi = s.training_interval(1)
    r = math.log(hi) - math.log(lo)
    assert tlo == pytest.approx(lo * math.exp(-0.1 * r)) and thi == pytest.approx(
        hi * math.exp(0.1 * r)
    )
    assert s.training_interval(0)[1] == 10.0, "the top block is clamped to sigma_max"
    assert s.training_interval(2)[0] == 1.0, "the bottom block is clamped to sigma_min"


def test_training_sigmas_stay_in_the_training_interval():
    s = schedule()
    gen = torch.Generator().manual_seed(0)
    for b in range(3):
        lo, hi = s.training_interval(b)
        sig = s.sample_training_sigma(b, 4096, gen)
        assert float(sig.min()) >= lo - 1e-5 and float(sig.max()) <= hi + 1e-5


@pytest.mark.parametrize("spb", [1, 2, 3, 5])
def test_sampler_grid_visits_blocks_in_order_inside_their_intervals(spb):
    s = schedule()
    grid = s.sampler_grid(spb)
    assert len(grid) == 3 * spb
    assert [b for b, _ in grid] == [b for b in range(3) for _ in range(spb)]
    assert grid[0][1] == 10.0 and grid[-1][1] == 1.0
    sigmas = [sig for _, sig in grid]
    assert sigmas == sorted(sigmas, reverse=True)
    for b, sig in grid:
        lo, hi = s.interval(b)
        assert lo - 1e-9 <= sig <= hi + 1e-9, (b, sig, lo, hi)


def test_edm_scalings_limits():
    sd = 0.5
    small = edm_scalings(torch.tensor([1e-6]), sd)
    assert small.c_skip.item() == pytest.approx(1.0, abs=1e-6)
    assert small.c_out.item() == pytest.approx(0.0, abs=1e-5)
    assert small.c_in.item() == pytest.approx(1 / sd, rel=1e-6)
    big = torch.tensor([1e6])
    large = edm_scalings(big, sd)
    assert large.c_skip.item() == pytest.approx(0.0, abs=1e-9)
    assert large.c_out.item() == pytest.approx(sd, rel=1e-6)
    assert (large.c_in * big).item() == pytest.approx(1.0, rel=1e-6)
    sig = torch.tensor([2.0])
    sc = edm_scalings(sig, sd)
    assert sc.c_noise.item() == pytest.approx(math.log(2) / 4)
    # unit-variance property: c_skip^2 sd^2 + c_out^2 ... the target's effective variance is 1
    assert (sc.c_in**2 * (sig**2 + sd**2)).item() == pytest.approx(1.0)


def test_loss_weight_is_edm_weight_times_sigma_data_squared():
    sd, sig = 0.3, torch.tensor([0.7, 3.0])
    edm = (sig**2 + sd**2) / (sig * sd) ** 2
    assert torch.allclose(loss_weight(sig, sd), edm * sd**2)


@pytest.mark.parametrize("spb", [1, 3])
def test_reversed_intervals_give_the_last_block_the_highest_noise(spb):
    """intervals = reversed: block b owns what block B-1-b owns forward, and the sweep visits
    the blocks B-1..0, each inside its own interval, from sigma_max down."""
    forward, flipped = schedule(), schedule(intervals="reversed")
    for b in range(3):
        assert flipped.interval(b) == forward.interval(2 - b)
        assert flipped.training_interval(b) == forward.training_interval(2 - b)
    grid = flipped.sampler_grid(spb)
    assert [b for b, _ in grid] == [b for b in (2, 1, 0) for _ in range(spb)]
    assert [s for _, s in grid] == [s for _, s in forward.sampler_grid(spb)]
    for b, sig in grid:
        lo, hi = flipped.interval(b)
        assert lo - 1e-9 <= sig <= hi + 1e-9


def test_intervals_are_checked():
    with pytest.raises(ConfigError, match="intervals"):
        ModelConfig(intervals="sideways")
