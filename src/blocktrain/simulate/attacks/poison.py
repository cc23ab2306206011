"""Data poisoning (`poison_*`; docs/simulate.md, "Attackers"): a real `LocalBlockTrainer` on the
wrong bytes. Only its byte source differs from an honest worker's, so its updates look honest to
every check on their shape: the question is whether the effect probe refuses them. There is no
other-language corpus offline, so `poison_foreign` transliterates the run's text into Cyrillic."""

from __future__ import annotations

import numpy as np

from blocktrain.data import ByteSource

REPEATED = ord("e")
LATIN_TO_CYRILLIC = "абцдефгхийклмнопярстувшьыз"  # a..z, all in а..я (capitals 0x20 below)


class MemorySource(ByteSource):
    """Bytes made in memory, sampled as a split's are: one array, no files. Built in the
    simulator's process and used there (it is not meant to be sent to another process)."""

    def __init__(self, name: str, data: np.ndarray) -> None:
        self.name = name
        self._spans = []
        self._arrays = [np.ascontiguousarray(data, dtype=np.uint8)]


def poisoned(kind: str, train: ByteSource, seed: int) -> MemorySource:
    """The byte source of a `kind` poisoner, made from the run's training split."""
    text = train.read()
    if kind == "poison_repeat":
        data = np.full(len(text), REPEATED, dtype=np.uint8)
    elif kind == "poison_shuffle":
        data = np.random.default_rng(seed).permutation(text)
    elif kind == "poison_foreign":
        data = cyrillic(text)
    else:
        raise ValueError(f"{kind!r} is not a poisoning attack")
    return MemorySource(f"{train.name}:{kind}", data)


def cyrillic(text: np.ndarray) -> np.ndarray:
    """UTF-8 `text` (uint8) with a..z and A..Z replaced by the Cyrillic letters of
    LATIN_TO_CYRILLIC (2 bytes each); every other byte kept."""
    first = np.arange(256, dtype=np.uint8)
    second = np.zeros(256, dtype=np.uint8)
    letter = np.zeros(256, dtype=bool)
    for i, small in enumerate(LATIN_TO_CYRILLIC):
        for latin, cyr in ((ord("a") + i, small), (ord("A") + i, chr(ord(small) - 0x20))):
            first[latin], second[latin] = cyr.encode()
            letter[latin] = True
    pairs = np.stack([first[text], second[text]], axis=1).reshape(-1)  # (2 x len,)
    keep = np.stack([np.ones(len(text), dtype=bool), letter[text]], axis=1).reshape(-1)
    return pairs[keep]
