"""The end-to-end reference split into pipeline stages with a key/value cache each: the
autoregressive serving baseline (docs/serving.md, "The autoregressive baseline"). Stage s of S
holds layers [s * L / S, (s + 1) * L / S) (the first also the embedding, the last the final norm
and head); chained, the stages give exactly `Reference.forward`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from blocktrain.config import ModelConfig
from blocktrain.model.cached import KVCache
from blocktrain.model.layers import DualStreamLayer, Rotary
from blocktrain.model.reference import Reference


def stage_layers(cfg: ModelConfig, stage: int, stages: int) -> range:
    """The reference layers of `stage` when its `cfg.layers` are split evenly into `stages`."""
    if stages < 1 or cfg.layers % stages != 0:
        raise ValueError(f"{cfg.layers} layers do not split into {stages} equal stages")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} outside 0..{stages - 1}")
    per = cfg.layers // stages
    return range(stage * per, (stage + 1) * per)


class ReferenceStage(nn.Module):
    """Stage `stage` of `stages` of the reference. Parameter names match `Reference`'s
    ("embed.*", "layers.{i}.*", "norm.*", "head.*"), so a stage loads straight from the
    reference's weights and holds nothing else."""

    def __init__(self, cfg: ModelConfig, stage: int, stages: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.stage, self.stages = stage, stages
        self.layer_ids = stage_layers(cfg, stage, stages)
        self.first, self.last = stage == 0, stage == stages - 1
        # Build the modules exactly as Reference does, on the meta device (no memory, no init
        # work), then keep this stage's and give them real (uninitialised) storage.
        with torch.device("meta"):
            full = Reference(cfg)
        self.embed: nn.Embedding | None = full.embed if self.first else None
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in self.layer_ids})
        self.norm: nn.LayerNorm | None = full.norm if self.last else None
        self.head: nn.Linear | None = full.head if self.last else None
        self.to_empty(device="cpu")
        self.rotary = Rotary(cfg.head_dim)  # a non-persistent buffer: built for real

    def forward(self, inp: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """inp: the new bytes (N, L) int64 on the first stage, else hidden states (N, L, d) from
        the stage before. Returns hidden states (N, L, d), or logits (N, L, 256) on the last
        stage; position i's logits predict the byte after it. The new tokens take positions
        cache.length .. cache.length + L - 1; the cache (if given) is extended in place."""
        h = self.embed(inp) if self.embed is not None else inp  # (N, L, d)
        layers = [(i, self.layers[str(i)]) for i in self.layer_ids]
        h = cached_clean_pass(layers, self.rotary, h, cache)
        if self.norm is not None and self.head is not None:
            return self.head(self.norm(h))  # (N, L, 256)
        return h


def cached_clean_pass(
    layers: Sequence[tuple[int, nn.Module]], rotary: Rotary, h: torch.Tensor, cache: KVCache | None
) -> torch.Tensor:
    """The clean stream's `layers` ((cache index, DualStreamLayer) pairs) on L new tokens h
    (N, L, d) at positions cache.length.. (the cache, if given, extended in place) -> (N, L, d):
    a reference stage's and a head stage's step alike."""
    start = cache.length if cache is not None else 0
    rot = rotary.rotation(torch.arange(start, start + h.shape[1], device=h.device))  # (L, hd/2)
    for i, layer in layers:
        assert isinstance(layer, DualStreamLayer)
        past = None
        if cache is not None and cache.length > 0:
            past = (cache.keys[i], cache.values[i])
        h, (k, v) = layer.attend_clean(h, rot, past)
        h = layer.mlp_clean(h)
        if cache is not None:
            cache.keys[i], cache.values[i] = k, v
    if cache is not None:
        cache.length = start + h.shape[1]
    return h


def split_reference(model: Reference, stages: int) -> list[ReferenceStage]:
    """The stages of a whole reference, holding copies of its weights (tests, benchmarks)."""
    out = []
    state = model.state_dict()
    for s in range(stages):
        stage = ReferenceStage(model.cfg, s, stages)
        own = stage.state_dict()
        stage.load_state_dict({name: state[name] for name in own})
        out.append(stage.to(next(model.parameters()).device).eval())
    return out
