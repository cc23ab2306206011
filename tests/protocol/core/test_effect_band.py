"""The effect probe's honest band over a whole run, in miniature: relative effects drawn like
cluster_small's (large gains early; late, one replica's delta moves the slice's loss about as
much up as down, with heavy tails), judged by `judge_effect` and scored by `Reputation` as the
engine does. No tensors: the dynamics of the band alone, every direction one that gains
(`honest`: the gain test passes)."""

from __future__ import annotations

import random

from blocktrain.protocol.core.effect import Effect, HonestBand, Reputation, helped, judge_effect

TOLERANCE, MIN_REPUTATION = 0.002, 0.1


def honest(relative: float) -> Effect:
    """A reading of an honest direction: its first-order gain 30 chance deviations, about
    the least that honest updates read at the tiny preset (29.3; BENCHMARKS.md, Poisoning)."""
    return Effect(1.0, 1.0 + relative, gain=0.03, chance=0.001)


def honest_effect(rng: random.Random, round_: int, rounds: int) -> float:
    """Mean gain decaying from -5 % to -0.05 %, spread 0.6 %, Student-t tails (df 3)."""
    mean = -0.05 * (0.001 / 0.05) ** (round_ / rounds)
    t = rng.gauss(0, 1) / (sum(rng.gauss(0, 1) ** 2 for _ in range(3)) / 3) ** 0.5
    return mean + 0.006 * t


def run(attack: float | None, rounds: int = 300, seed: int = 0) -> dict[str, object]:
    rng = random.Random(seed)
    band, reputation = HonestBand(), Reputation(MIN_REPUTATION)
    accepted = {"a": 0, "b": 0, "evil": 0}
    lowest = {"a": 1.0, "b": 1.0}
    excluded_rounds = {"a": 0, "b": 0}
    for r in range(rounds):
        sent = {"a": honest_effect(rng, r, rounds), "b": honest_effect(rng, r, rounds)}
        if attack is not None:
            sent["evil"] = attack
        for who, relative in sent.items():  # as RoundEngine.check, then .record
            excluded = not reputation.excluded(who).accepted
            if excluded and who in excluded_rounds:
                excluded_rounds[who] += 1
            effect = honest(relative)
            probed = judge_effect(effect, TOLERANCE, band)
            score = helped(probed, effect)
            if score is not None:  # excluded ones are probed too
                reputation.observe(who, helpful=score)
            if probed.accepted and not excluded:
                accepted[who] += 1
                band = band.add(relative)
            if who in lowest:
                lowest[who] = min(lowest[who], reputation.of(who))
    return {
        "accepted": accepted,
        "lowest": lowest,
        "excluded_rounds": excluded_rounds,
        "band": band.upper,
    }


def test_honest_workers_keep_their_standing_through_a_whole_run():
    """Updates that do not lower the slice's loss are refused (late in the run about half),
    but honest identities are excluded for at most a few rounds, and come back."""
    for seed in range(5):
        out = run(attack=None, seed=seed)
        accepted, excluded = out["accepted"], out["excluded_rounds"]
        assert isinstance(accepted, dict) and isinstance(excluded, dict)
        assert min(accepted["a"], accepted["b"]) >= 0.75 * 300, (seed, accepted)
        assert max(excluded.values()) <= 0.02 * 300, (seed, excluded)


def test_a_fixed_tolerance_alone_excludes_them():
    """The failure the band mends (cluster_small, session 7): without it, late noise is
    judged harmful until every honest identity is excluded."""
    rng = random.Random(0)
    reputation = Reputation(MIN_REPUTATION)
    for r in range(300):
        for who in ("a", "b"):
            if not reputation.excluded(who).accepted:
                continue
            effect = honest(honest_effect(rng, r, 300))
            score = helped(judge_effect(effect, TOLERANCE), effect)
            if score is not None:
                reputation.observe(who, helpful=score)
    assert all(not reputation.excluded(w).accepted for w in ("a", "b"))


def test_a_delta_that_clearly_harms_is_refused_all_run_long():
    out = run(attack=0.05)  # +5 % on the slice: far outside the honest band, late or early
    accepted = out["accepted"]
    assert isinstance(accepted, dict) and accepted["evil"] == 0
    band = out["band"]
    assert isinstance(band, float) and 0 < band < 0.05
