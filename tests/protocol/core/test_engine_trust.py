"""The round engine's defences against poisoning, driven with virtual time and small tensors:
discarding accepted updates, the robust defaults, the effect probe and reputation."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from blocktrain.errors import ConfigError
from blocktrain.presets import tiny
from blocktrain.protocol.core.bounds import derived_settings, largest_block
from blocktrain.protocol.core.events import Committed
from blocktrain.protocol.core.round_engine import RoundEngine
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.training.local import initial_blocks
from tests.protocol.conftest import block_tensors, delta_body

BASE = block_tensors(100)
SETTINGS = AggregatorSettings(
    deadline_s=30.0,
    max_delta_norm=1e4,
    max_tokens=10**12,
    wire_dtype="fp32",
    min_round_s=0.0,
    probe_step=1.0,  # the effects below are sized for the whole update
)


class TargetProbe:
    """A stand-in for the block's loss: the squared distance to a target, which honest
    updates approach."""

    def __init__(self, target: dict[str, torch.Tensor]) -> None:
        self.target = target
        self.calls = 0

    def window_losses(self, block: int, weights: dict[str, torch.Tensor], others=None, draw=0):
        self.calls += 1
        distance = sum(float(((weights[k].float() - t) ** 2).sum()) for k, t in self.target.items())
        return torch.tensor([distance])  # one window: no spread, so only a fall is accepted

    def gradient(self, block: int, weights: dict[str, torch.Tensor], others=None, draw=0):
        return {k: 2 * (w.float() - self.target[k]) for k, w in weights.items()}


def engine(settings: AggregatorSettings = SETTINGS, probe: TargetProbe | None = None):
    eng = RoundEngine.fresh({0: BASE}, settings, probe=probe)
    commits: list[Committed] = []
    eng.on_commit.append(commits.append)
    return eng, commits


def join(eng: RoundEngine, n: int, token_of=lambda i: i) -> list[int]:
    ids = iter(range(1000))
    workers = [eng.register(0.0, 0, lambda _b: next(ids), token_of(i)).worker for i in range(n)]
    for w in workers:
        eng.pull(w, 0, 0.0)
    return workers


def push(eng: RoundEngine, worker: int, tensors: dict, *, tokens: int = 100, uid: int = -1):
    checked = eng.check(0, delta_body(0, tensors=tensors, tokens=tokens, dtype="fp32"), worker)
    verdict = checked.verdict
    if verdict.accepted:
        assert checked.meta is not None
        verdict = eng.judge(worker, 0, checked.meta, 1.0)
    eng.record(worker, 0, verdict, 1.0, checked=checked, update_id=uid)
    eng.tick(1.0)
    return verdict


def toward(target: dict[str, torch.Tensor], frac: float) -> dict[str, torch.Tensor]:
    return {k: frac * (target[k] - BASE[k]) for k in BASE}


def test_discard_takes_accepted_updates_out_of_the_open_round():
    """Revoking a token must drop its pending update (finding, Recovery): `discard` is the
    engine's half of it."""
    eng, commits = engine()
    a, b, c = join(eng, 3)
    honest = {k: torch.full_like(v, 0.01) for k, v in BASE.items()}
    assert push(eng, a, honest, uid=11).accepted
    assert push(eng, b, {k: torch.full_like(v, 0.5) for k, v in BASE.items()}, uid=12).accepted
    assert eng.discard(0, [12, 999]) == [12]
    assert [x.update_id for x in eng.blocks[0].rounds.accepted] == [11]
    assert push(eng, c, honest, uid=13).accepted
    # b's update was taken out, and b cannot push again (a duplicate): a and c close the round
    (event,) = commits
    assert [x.update_id for x in event.closed.accepted] == [11, 13]
    for k in BASE:
        assert torch.allclose(event.weights[k], BASE[k] + 0.01, atol=1e-6), k


def test_a_round_whose_updates_were_all_discarded_commits_no_new_version():
    eng, commits = engine()
    a, _ = join(eng, 2)
    assert push(eng, a, {k: torch.full_like(v, 3.0) for k, v in BASE.items()}, uid=5).accepted
    eng.discard(0, [5])
    eng.tick(100.0)  # the deadline
    (event,) = commits
    assert not event.changed and event.closed.new_version == 0
    assert all(torch.equal(event.weights[k], BASE[k]) for k in BASE)


def test_one_accepted_update_cannot_flip_a_block_under_the_defaults():
    """Finding (Poisoning): one worker's accepted update turned block 0 into -0.76x its
    weights. Even with a loose norm bound and no probe, the clipped identity mean moves the
    block by at most about c x an honest update's norm over the votes."""
    eng, commits = engine()
    a, b, evil = join(eng, 3)
    honest = {k: 0.01 * torch.randn_like(v) for k, v in BASE.items()}
    flip = {k: -1.76 * v for k, v in BASE.items()}
    for w, d, t in ((a, honest, 100), (b, honest, 100), (evil, flip, 10**9)):
        assert push(eng, w, d, tokens=t).accepted
    (event,) = commits
    for k in BASE:
        moved = float((event.weights[k] - BASE[k]).norm())
        assert moved <= 2 * float(honest[k].norm()), k
        cos = torch.nn.functional.cosine_similarity(
            event.weights[k].flatten(), BASE[k].flatten(), dim=0
        )
        assert cos > 0.99, k
    old, old_commits = engine(SETTINGS.replace(clip=0.0, weighting="reported"))
    for w, d, t in zip(join(old, 3), (honest, honest, flip), (100, 100, 10**9), strict=True):
        push(old, w, d, tokens=t)
    cos = torch.nn.functional.cosine_similarity(
        old_commits[0].weights["embed"].flatten(), BASE["embed"].flatten(), dim=0
    )
    assert cos < -0.99, "without the defences the flip goes through"


def test_sybils_of_one_token_are_one_vote_in_the_engine():
    """Finding (Identity/Poisoning): each Sybil voted. Four workers of one token count once."""
    eng, commits = engine(SETTINGS.replace(clip=0.0, max_workers_per_token=4))
    workers = join(eng, 6, token_of=lambda i: 1 if i < 4 else 100 + i)
    for w in workers:
        d = 1.0 if w < 4 else 0.0  # the Sybils push 1.0, the two honest 0.0
        assert push(eng, w, {k: torch.full_like(v, d) for k, v in BASE.items()}).accepted
    (event,) = commits
    assert torch.allclose(event.weights["embed"], BASE["embed"] + 1 / 3, atol=1e-6)


def test_a_round_the_rule_refuses_commits_the_old_weights_and_says_why():
    eng, commits = engine(SETTINGS.replace(rule="trimmed_mean", tolerate=1))
    a, b = join(eng, 2)
    for w in (a, b):
        assert push(eng, w, {k: torch.full_like(v, 0.1) for k, v in BASE.items()}).accepted
    (event,) = commits
    assert event.changed and event.closed.new_version == 1, "the version moves on, unchanged"
    assert "needs more than 2 votes; 2 came" in event.held
    assert all(torch.equal(event.weights[k], BASE[k]) for k in BASE)


def test_the_effect_probe_refuses_harmful_updates_and_reputation_excludes_their_identity():
    target = {k: v + 1.0 for k, v in BASE.items()}
    probe = TargetProbe(target)
    eng, commits = engine(probe=probe)
    a, b, evil = join(eng, 3)
    assert push(eng, a, toward(target, 0.1)).accepted
    calls = probe.calls
    assert calls == 2, "before (once per version) and after"
    bad = push(eng, evil, toward(target, -0.1))
    assert not bad.accepted and bad.reason == "harmful" and "tolerance" in bad.detail
    assert probe.calls == calls + 1, "the loss before is cached for the version"
    assert eng.reputation.of(("token", evil)) == 0.5
    assert push(eng, b, toward(target, 0.1)).accepted
    # evil, refused, can no longer pass: the round closes on a and b, not at its deadline
    assert commits and commits[0].closed.new_version == 1
    assert commits[0].closed.cause == "all_reported"
    for _ in range(3):  # rounds 1..3: each harmful push halves the reputation
        assert push_round(eng, evil, toward(target, -0.1)).reason in ("harmful", "low_reputation")
    excluded = eng.reputation.of(("token", evil))
    assert excluded < SETTINGS.min_reputation
    last = push_round(eng, evil, toward(target, 0.1))
    assert last.reason == "low_reputation", "an excluded identity's update is refused..."
    assert eng.reputation.of(("token", evil)) == pytest.approx(excluded + 0.1)
    assert push_round(eng, evil, toward(target, 0.1)).accepted, "...but earns its way back"


def test_an_honest_band_forgives_noise_but_not_harm():
    """Finding (cluster_small): late in a run one replica's honest 10-step delta raised the
    probe's loss by up to 1.8 %, the fixed 0.2 % tolerance judged 35 of them harmful, and
    every honest worker was excluded. Such an update is still refused, but within the band of
    recent accepted effects it is `no_gain` and costs no reputation; harm beyond it does."""
    target = {k: v + 1.0 for k, v in BASE.items()}
    eng, _ = engine(SETTINGS.replace(max_workers_per_token=1), probe=TargetProbe(target))
    a, b, c = join(eng, 3)
    noise = toward(target, -0.0015)  # the slice's loss rises by 0.3 %
    assert eng.check(0, body_for(eng, noise), a).verdict.reason == "harmful", "no band yet"
    for i in range(3):  # accepted updates lowering the loss by 0.4 %, 0.2 % and 0.02 %
        for w, f in zip((a, b, c), (0.002, 0.001, 0.0001), strict=True):
            assert push_round(eng, w, toward(target, f)).accepted, (i, w)
    upper = eng.bands[0].upper
    assert upper is not None and 0.003 < upper < 0.03
    forgiven = push_round(eng, a, noise)
    assert forgiven.reason == "no_gain" and eng.reputation.of(("token", a)) == 1.0
    harm = push_round(eng, b, toward(target, -0.1))
    assert harm.reason == "harmful" and "recent accepted updates up to" in harm.detail
    assert eng.reputation.of(("token", b)) == 0.5


def test_an_update_that_does_not_lower_the_loss_is_never_accepted():
    """Finding (bench/adversarial.py, four_tokens): while the band decided acceptance, four
    tokens on one block (against its two honest workers) widened it and had their shrinking
    updates accepted, +2.0 CE. Acceptance rests on the update lowering the loss, whatever the
    band says, so a majority cannot loosen it."""
    target = {k: v + 1.0 for k, v in BASE.items()}
    eng, _ = engine(SETTINGS.replace(max_workers_per_token=1), probe=TargetProbe(target))
    workers = join(eng, 6)
    nothing = {k: torch.zeros_like(v) for k, v in BASE.items()}
    assert eng.check(0, body_for(eng, nothing), workers[0]).verdict.reason == "no_gain"
    for _ in range(3):  # helpful updates of very different sizes: a band reaching above zero
        for w, f in zip(workers, (0.2, 0.1, 0.0001, 0.0001, 0.05, 0.0002), strict=True):
            assert push_round(eng, w, toward(target, f)).accepted
    upper = eng.bands[0].upper
    assert upper is not None and upper > 0
    for w in workers:
        assert eng.check(0, body_for(eng, nothing), w).verdict.reason == "no_gain"


def body_for(eng: RoundEngine, tensors: dict) -> bytes:
    st = eng.blocks[0].rounds
    return delta_body(0, tensors=tensors, round=st.round, base_version=st.version, dtype="fp32")


def push_round(eng: RoundEngine, worker: int, tensors: dict):
    checked = eng.check(0, body_for(eng, tensors), worker)
    eng.record(worker, 0, checked.verdict, 1.0, checked=checked)
    eng.tick(1.0)
    return checked.verdict


def test_the_probe_setting_turns_it_off():
    probe = TargetProbe({k: v + 1.0 for k, v in BASE.items()})
    eng, _ = engine(SETTINGS.replace(effect_probe="off"), probe=probe)
    (w,) = join(eng, 1)
    assert push(eng, w, toward(probe.target, -0.1)).accepted and probe.calls == 0


def test_the_default_norm_bound_is_a_few_honest_updates_not_the_whole_block():
    """Finding (Poisoning): the bound (56.25 at tiny) was 1.7x the norm of the whole trained
    block and ~22x an honest update. It is now derived from measured honest deltas (largest
    3.96 at tiny, docs/protocol.md), so the -0.76x flip of even the initial block is refused."""
    cfg = tiny()
    initial = initial_blocks(cfg)
    bound = derived_settings(cfg, {}, largest_block(initial)).max_delta_norm
    assert 3.96 < bound < 2.5 * 3.96
    flip = 1.76 * math.sqrt(sum(float(v.pow(2).sum()) for v in initial[0].values()))
    assert flip > bound


def test_the_aggregator_needs_data_for_its_probe_or_the_probe_off(tmp_path, monkeypatch):
    """`blocktrain aggregator` builds the probe from --data or $BLOCKTRAIN_DATA; without either
    it stops with one clear line (exit 2) instead of serving without the defence."""
    from blocktrain.cli.aggregator import effect_probe
    from blocktrain.protocol.store.state import create_state

    monkeypatch.delenv("BLOCKTRAIN_DATA", raising=False)
    cfg = tiny()
    state = create_state(tmp_path / "agg", cfg, {}, initial_blocks(cfg))
    args = argparse.Namespace(data=None)
    with pytest.raises(ConfigError, match="effect probe needs the data"):
        effect_probe(args, state, state.settings())
    assert effect_probe(args, state, state.settings().replace(effect_probe="off")) is None
    state.close()


def test_an_update_that_changes_nothing_is_refused_without_reputation_cost():
    """Four tokens shrinking a block whose output is still zero do not move its loss; counted,
    they outvoted the block's honest workers every round (bench/adversarial.py, four_tokens)."""
    target = {k: v + 1.0 for k, v in BASE.items()}
    probe = TargetProbe(target)
    eng, _ = engine(probe=probe)
    (w,) = join(eng, 1)
    verdict = push(eng, w, {k: torch.zeros_like(v) for k, v in BASE.items()})
    assert not verdict.accepted and verdict.reason == "no_gain"
    assert eng.reputation.of(("token", w)) == 1.0
