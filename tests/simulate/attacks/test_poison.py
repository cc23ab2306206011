"""Poisoners: honest training on substituted bytes (simulate/attacks/poison.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from blocktrain.data import load_split
from blocktrain.protocol.core.bounds import derived_settings, largest_block
from blocktrain.simulate.attacks import Attack, Hostiles
from blocktrain.simulate.attacks.poison import REPEATED, cyrillic, poisoned
from blocktrain.training.local import LocalBlockTrainer, initial_blocks, local_trainer
from tests.conftest import micro_config

CFG = micro_config("features")  # a replica of block 2 reads blocks 0, 1


def as_bytes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), dtype=np.uint8)


def test_cyrillic_replaces_latin_letters_only_with_two_byte_letters() -> None:
    out = cyrillic(as_bytes("Hello, World 42 = é")).tobytes().decode("utf-8")
    assert out == "Хелло, Шорлд 42 = é"
    text = as_bytes("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    letters = cyrillic(text).tobytes().decode("utf-8").split()
    assert [len(w) for w in letters] == [26, 26] and len(set(letters[0])) == 26, "one to one"
    assert letters[1] == letters[0].upper()
    assert len(cyrillic(text)) == 2 * 52 + 1


def test_poisoned_sources_hold_what_their_kind_says(corpus: Path) -> None:
    train = load_split(corpus, "train")
    text = train.read()
    repeat = poisoned("poison_repeat", train, 0).read()
    assert len(repeat) == len(text) and set(repeat.tolist()) == {REPEATED}
    shuffled = poisoned("poison_shuffle", train, 0).read()
    assert np.array_equal(np.sort(shuffled), np.sort(text)), "the same unigram counts"
    assert not np.array_equal(shuffled, text)
    assert np.array_equal(shuffled, poisoned("poison_shuffle", train, 0).read()), "seeded"
    foreign = poisoned("poison_foreign", train, 0).read().tobytes().decode("utf-8")
    assert not any("a" <= c.lower() <= "z" for c in foreign)
    assert len(foreign) == len(text), "one character for each byte of the (ASCII) text"


def test_a_poisoner_trains_for_real_on_its_bytes(corpus: Path) -> None:
    train, valid = load_split(corpus, "train"), load_split(corpus, "valid")
    initial = initial_blocks(CFG)
    settings = derived_settings(CFG, {"local_steps": 2}, largest_block(initial))
    hostiles = Hostiles(
        Attack("poison_repeat", block=2),
        CFG,
        settings,
        train,
        valid,
        unit="block",
        n_workers=6,
        probe_skip=512,
        seed=0,
    )
    poisoner = hostiles.trainer(0, 6, 2)
    assert isinstance(poisoner, LocalBlockTrainer)
    batch = poisoner.data.sample(4, CFG.model.seq_len, torch.Generator().manual_seed(0))
    assert bool((batch == REPEATED).all()), "its batches hold the repeated byte alone"
    honest = local_trainer(CFG, "block", 2, train, data_seed=poisoner.data_seed)
    logs = []
    for t in (poisoner, honest):
        t.load(initial[2])
        t.load_upstream({b: initial[b] for b in (0, 1)})
        logs.append(t.train(2, 0))
    assert logs[0]["steps"] == logs[1]["steps"] == 2 and logs[0]["tokens"] == logs[1]["tokens"]
    assert abs(logs[0]["loss"] - logs[1]["loss"]) > 1e-3, "same seed, other bytes: other loss"
    assert any(v.abs().max() > 0 for v in poisoner.delta().values()), "real AdamW steps"
