"""Hostile workers for the simulator (BENCHMARKS.md, Poisoning; `bench/adversarial.py`).

An attacker is a virtual worker like any other: it registers, pulls and pushes on the virtual
clock, with a trainer that deviates from an honest one's (`Hostiles` builds them):

    shrink          -s x the block's weights, s as large as the bound allows (at most 1.76: the
                    issue's "-0.76x its weights")                                    forge.py
    bias            one coordinate at the bound, zeros elsewhere: the logit bias of byte 0 in
                    the block's output head (`head.bias`), else the first coordinate of the
                    first tensor                                                     forge.py
    noise           Gaussian noise scaled to the bound, fresh each round             forge.py
    poison_repeat   honest training on one repeated byte                            poison.py
    poison_shuffle  honest training on the run's bytes shuffled                     poison.py
    poison_foreign  honest training on the run's text in Cyrillic letters           poison.py
    drift           0.9 x its honest delta plus the largest bias on byte 0's logit that its
                    own copy of the effect probe still passes                       probed.py
    ascend          overfits the probe's windows, ascends the real loss orthogonally to the
                    probe's gradient, at the bound                                  probed.py
    copy            an exact copy of an honest worker's delta of the same round     echoes.py
    replay          an honest delta accepted in an earlier round, with fresh metadata
                                                                                    echoes.py

Forged and crafted deltas (shrink, bias, noise, ascend) sit at the aggregator's norm bound and
claim the largest token count it accepts (which bought weight under the old token-weighted
mean); the others claim what their honest training (or the honest push they echo) counted.
`Attack.count` attackers, all on `block` (default: where the registry puts them), each with a
token of its own or all under one (`shared_token`: Sybils).
"""

from blocktrain.simulate.attacks.forge import ForgingTrainer
from blocktrain.simulate.attacks.hostiles import Hostiles
from blocktrain.simulate.attacks.spec import KINDS, Attack

__all__ = ["KINDS", "Attack", "ForgingTrainer", "Hostiles"]
