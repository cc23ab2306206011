"""Echoes of honest work (simulate/attacks/echoes.py), and what the replay screen does with
them."""

from __future__ import annotations

from pathlib import Path

import torch

from blocktrain.protocol.core.verdict import Verdict
from blocktrain.simulate.aggregator import Judged
from blocktrain.simulate.attacks import Attack
from blocktrain.simulate.attacks.echoes import EchoTrainer, Watched, Witness
from tests.simulate.test_attacks import run


class Honest:
    """A trainer whose delta is fresh noise each round."""

    def __init__(self) -> None:
        self.upstream_blocks = [0]
        self.step = 0

    def load(self, weights):
        pass

    def load_upstream(self, blocks):
        pass

    def train(self, steps, first_step, should_stop=lambda: False):
        self.step = first_step
        return {"tokens": 64.0, "loss": 2.5, "steps": float(steps)}

    def delta(self):
        return {"w": torch.randn(3, generator=torch.Generator().manual_seed(self.step))}


def push(trainer, first_step: int) -> tuple[dict, dict]:
    trainer.load({"w": torch.zeros(3)})
    return trainer.train(2, first_step), trainer.delta()


def test_copy_pushes_the_honest_delta_of_the_same_step_and_its_claims() -> None:
    witness = Witness()
    honest = Watched(Honest(), witness, worker=1, block=2)
    copier = EchoTrainer("copy", witness, 2, honest.upstream_blocks)
    assert copier.upstream_blocks == [0], "it pulls what the honest replica pulls"
    assert torch.equal(push(copier, 0)[1]["w"], torch.zeros(3)), "nothing to copy yet: zeros"
    for step in (0, 2):
        logs, delta = push(honest, step)
        copied_logs, copied = push(copier, step)
        assert torch.equal(copied["w"], delta["w"]), step
        assert copied_logs["tokens"] == logs["tokens"] and copied_logs["loss"] == logs["loss"]
    assert push(EchoTrainer("copy", witness, 1, []), 2)[1]["w"].abs().sum() == 0, "other block"


def test_replay_pushes_an_accepted_honest_delta_of_an_earlier_step() -> None:
    witness = Witness()
    honest = Watched(Honest(), witness, worker=1, block=2)
    replayer = EchoTrainer("replay", witness, 2, [])
    _, first = push(honest, 0)
    witness.judged(Judged(1, 2, 0, Verdict.ok()))
    _, refused = push(honest, 2)
    witness.judged(Judged(1, 2, 1, Verdict.refuse("no_gain", "")))
    witness.judged(Judged(7, 2, 1, Verdict.ok()))  # an attacker's verdict: not watched
    assert replayer.train(2, 0)["tokens"] == 1.0, "nothing accepted before step 0"
    assert torch.equal(push(replayer, 4)[1]["w"], first["w"]), "the accepted one, not the last"
    assert push(replayer, 4)[0]["tokens"] == 64.0
    assert not torch.equal(first["w"], refused["w"])


def test_the_replay_screen_refuses_copies_and_replays(corpus: Path) -> None:
    """Under the defaults every copy of another identity's tensors is refused `copy`, and
    every replay `copy` too: what it echoes is another identity's accepted delta (round 0's
    replay has nothing to echo: zeros, `no_gain`); with the screen off a copy passes the probe
    and doubles an honest vote."""
    for kind, expected in (("copy", {"copy": 3}), ("replay", {"no_gain": 1, "copy": 2})):
        result, _ = run(corpus, Attack(kind, block=2), {}, rounds=3)
        (attacker,) = [w for w in result["workers"] if w["attacker"]]
        assert attacker["refused"] == expected and attacker["accepted"] == 0, kind
        assert all(not w["refused"] for w in result["workers"] if not w["attacker"]), kind
    result, _ = run(corpus, Attack("copy", block=2), {"replay_rounds": 0}, rounds=3)
    (attacker,) = [w for w in result["workers"] if w["attacker"]]
    assert attacker["accepted"] == 3, "the probe cannot tell a copy from the original"
