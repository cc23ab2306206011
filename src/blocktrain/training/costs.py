"""What the worker of each block costs: FLOPs per local step, training memory, bytes per round, and
under a device profile seconds per step and per round; one place for these figures (`blocktrain
plan`, the shape plans, the simulator's clock). How each is counted: docs/serving.md, "What a
worker costs"."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from blocktrain.config import VOCAB_SIZE, ModelConfig, RunConfig
from blocktrain.errors import ConfigError
from blocktrain.model import Block, Reference, ZLayout
from blocktrain.model.layers import DualStreamLayer
from blocktrain.relaystream import Shape, bytes_per_step, relayed_steps
from blocktrain.training.flops import count_flops
from blocktrain.training.optim import ADAMW_BYTES_PER_PARAM
from blocktrain.training.profiles import DeviceProfile

TRAINED_BYTES = {"weights": 4, "grads": 4, "adamw_moments": ADAMW_BYTES_PER_PARAM}
"""What a worker holds per parameter of the block it trains (fp32 weight, gradient, moments)."""
TRAINED_BYTES_PER_PARAM = sum(TRAINED_BYTES.values())
UPSTREAM_BYTES_PER_PARAM = 2  # a frozen upstream block, held in 16-bit as the wire sends it
TABLE_BYTES_PER_VALUE = 4  # the target table E (256, d), fp32
FEATURES_FP32_BYTES = 4  # the relayed input features, dequantised for the step
WIRE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def wire_bytes(dtype: str) -> int:
    """Bytes a parameter takes on the wire in `dtype` (the protocol's `wire_dtype`)."""
    if dtype not in WIRE_BYTES:
        raise ConfigError(f"wire dtype {dtype!r} is not one of {', '.join(WIRE_BYTES)}")
    return WIRE_BYTES[dtype]


def count_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _meta_block(m: ModelConfig) -> Block:
    """A block of `m` on the meta device (every block of a run has this shape)."""
    with torch.device("meta"):
        return Block(m)


def clean_stream_params(block: Block) -> int:
    """The parameters of a block's clean stream (its byte embeddings and layers less their z-stream
    modulation): what a worker holds of each upstream block under `route = features`."""
    modulation = sum(
        count_params(layer.modulation)
        for layer in block.layers
        if isinstance(layer, DualStreamLayer) and layer.modulation is not None
    )
    return count_params(block.embed) + count_params(block.layers) - modulation


def stream_shape(cfg: RunConfig) -> Shape:
    """What each step of this run's relayed streams holds: N sequences of T bytes, d features
    at `relay_bits`."""
    return Shape(cfg.train.batch_size, cfg.model.seq_len, cfg.model.d_model, cfg.train.relay_bits)


def relay_step_bytes(cfg: RunConfig) -> int:
    """One relayed step of a clean stream: batch x T x (d bits / 8 + 5) bytes (relaystream)."""
    s = stream_shape(cfg)
    return bytes_per_step(s.batch, s.seq_len, s.d_model, s.bits)


def _trained(params: int) -> dict[str, int]:
    return {name: params * size for name, size in TRAINED_BYTES.items()}


def worker_memory(cfg: RunConfig) -> list[dict[str, int]]:
    """Each block's worker's training memory, broken down, with `total`; under `relay` one local
    step of the streams, as the worker spools a round's stream to disk a step at a time."""
    m = cfg.model
    block = _meta_block(m)
    params, stream = count_params(block), clean_stream_params(block)
    relay = m.route == "relay"
    step = relay_step_bytes(cfg)
    features_fp32 = cfg.train.batch_size * m.seq_len * m.d_model * FEATURES_FP32_BYTES
    out = []
    for b in range(m.blocks):
        memory = {
            **_trained(params),
            "target_table": VOCAB_SIZE * m.d_model * TABLE_BYTES_PER_VALUE,
            "upstream_fp16": b * stream * UPSTREAM_BYTES_PER_PARAM * (m.route == "features"),
            "relay_stream_in": step * (relay and b > 0),
            "relay_stream_out": step * (relay and b < m.blocks - 1),
            "relay_features_fp32": features_fp32 * (relay and b > 0),
        }
        memory["total"] = sum(memory.values())
        out.append(memory)
    return out


def _meta_inputs(m: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ZLayout]:
    """One training sequence on meta: x_bytes (1, T), z (1, T, d), sigma (1,), the layout."""
    x = torch.zeros(1, m.seq_len, dtype=torch.long, device="meta")
    z = torch.zeros(1, m.seq_len, m.d_model, device="meta")
    sigma = torch.ones(1, device="meta")
    return x, z, sigma, ZLayout.training(m.seq_len, m.span, "meta")


@torch.no_grad()
def _forward_flops(m: ModelConfig, block: Block, with_upstream: bool) -> int:
    """One sequence through `block` as BlockLoss runs it (with the aux head when the loss
    uses it; with the upstream features block b > 0 reads)."""
    x, z, sigma, layout = _meta_inputs(m)
    upstream = torch.zeros(1, m.seq_len, m.d_model, device="meta") if with_upstream else None
    return count_flops(
        lambda: block(x, z, sigma, layout, with_aux=m.aux_weight > 0, upstream=upstream)
    ).total


@torch.no_grad()
def _clean_stream_flops(m: ModelConfig, block: Block) -> int:
    """One sequence through one upstream block's clean stream (what BlockStack.upstream runs
    for each block before b; the features it adds cost no products)."""
    x = torch.zeros(1, m.seq_len, dtype=torch.long, device="meta")
    return count_flops(lambda: block.clean_stream(x)).total


def worker_flops(cfg: RunConfig) -> list[dict[str, int]]:
    """Each block's worker's FLOPs per local step: `train`, `upstream` and `total`."""
    m, batch = cfg.model, cfg.train.batch_size
    block = _meta_block(m)
    first = _forward_flops(m, block, with_upstream=False)
    # every block after the first reads block b-1's stream under features and relay alike
    later = _forward_flops(m, block, with_upstream=True) if m.reads_upstream else first
    clean = _clean_stream_flops(m, block) if m.route == "features" and m.blocks > 1 else 0
    out = []
    for b in range(m.blocks):
        flops = {"train": 3 * batch * (first if b == 0 else later), "upstream": batch * b * clean}
        flops["total"] = flops["train"] + flops["upstream"]
        out.append(flops)
    return out


def _round(pull: int, upstream: int, stream_in: int, stream_out: int) -> dict[str, int]:
    """One round's bytes: the pull and the push (the same size: a dense delta), and the sums."""
    counts = {
        "pull": pull,
        "push": pull,
        "upstream": upstream,
        "stream_in": stream_in,
        "stream_out": stream_out,
    }
    counts["down"] = pull + upstream + stream_in
    counts["up"] = pull + stream_out
    counts["total"] = counts["down"] + counts["up"]
    return counts


def round_bytes(cfg: RunConfig, *, local_steps: int, wire_dtype: str) -> list[dict[str, int]]:
    """Each worker's bytes a round of `local_steps` (docs/serving.md, What a worker costs)."""
    m = cfg.model
    block = wire_bytes(wire_dtype) * count_params(_meta_block(m))
    relayed = relayed_steps(local_steps, cfg.train.relay_every)
    stream = relayed * relay_step_bytes(cfg) if m.route == "relay" else 0
    return [
        _round(
            block,
            b * block * (m.route == "features"),
            stream * (b > 0),
            stream * (b < m.blocks - 1),
        )
        for b in range(m.blocks)
    ]


@dataclass(frozen=True)
class WorkerCost:
    """What one worker costs: a block's (`unit = block`) or a whole reference's (DiLoCo)."""

    unit: str
    index: int
    local_steps: int
    """H, the local steps of the round `bytes_per_round` counts."""
    flops: dict[str, int]
    memory: dict[str, int]
    bytes_per_round: dict[str, int]

    @property
    def flops_per_step(self) -> int:
        return self.flops["total"]

    @property
    def memory_bytes(self) -> int:
        return self.memory["total"]

    def step_s(self, profile: DeviceProfile) -> float:
        """Seconds of one local step at the profile's sustained rate."""
        return self.flops_per_step / profile.flops_per_s

    def transfer_s(self, profile: DeviceProfile) -> float:
        """Seconds of a round's transfers: down over the link's download, up over its upload."""
        b = self.bytes_per_round
        return b["down"] / profile.link_down_bytes_per_s + b["up"] / profile.link_up_bytes_per_s

    def round_s(self, profile: DeviceProfile, *, compute_factor: float = 1.0) -> float:
        """H steps (times `compute_factor`, a worker's slowness), the transfers and two
        latencies (the pull's answer and the push)."""
        return (
            self.local_steps * self.step_s(profile) * compute_factor
            + self.transfer_s(profile)
            + 2 * profile.latency_s
        )

    def fits(self, profile: DeviceProfile) -> bool:
        return self.memory_bytes <= profile.memory_bytes

    def to_dict(self, profile: DeviceProfile | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            self.unit: self.index,
            "flops_per_step": self.flops_per_step,
            "flops": dict(self.flops),
            "memory_bytes": self.memory_bytes,
            "memory": dict(self.memory),
            "bytes_per_round": dict(self.bytes_per_round),
        }
        if profile is not None:
            out.update(
                step_s=self.step_s(profile),
                transfer_s=self.transfer_s(profile),
                round_s=self.round_s(profile),
                fits=self.fits(profile),
            )
        return out


def worker_costs(cfg: RunConfig, *, local_steps: int, wire_dtype: str = "fp16") -> list[WorkerCost]:
    """Every block's worker, in block order."""
    return [
        WorkerCost("block", b, local_steps, flops, memory, counts)
        for b, (flops, memory, counts) in enumerate(
            zip(
                worker_flops(cfg),
                worker_memory(cfg),
                round_bytes(cfg, local_steps=local_steps, wire_dtype=wire_dtype),
                strict=True,
            )
        )
    ]


@torch.no_grad()
def reference_cost(cfg: RunConfig, *, local_steps: int, wire_dtype: str = "fp16") -> WorkerCost:
    """A DiLoCo replica: the whole end-to-end reference (`layers` deep) trained per worker, with
    no target table; each round it pulls the model and pushes its delta."""
    m = cfg.model
    with torch.device("meta"):
        model = Reference(m)
    x = torch.zeros(1, m.seq_len, dtype=torch.long, device="meta")
    forward = count_flops(lambda: model(x)).total
    params = count_params(model)
    flops = {"train": 3 * cfg.train.batch_size * forward, "upstream": 0}
    flops["total"] = flops["train"]
    memory = {**_trained(params), "total": params * TRAINED_BYTES_PER_PARAM}
    counts = _round(params * wire_bytes(wire_dtype), 0, 0, 0)
    return WorkerCost("reference", 0, local_steps, flops, memory, counts)


def unit_costs(
    cfg: RunConfig, unit: str, *, local_steps: int, wire_dtype: str = "fp16"
) -> dict[int, WorkerCost]:
    """Unit index -> its worker's cost: the blocks, or the one reference (simulate `--set unit=reference`, `--reference`)."""
    if unit == "reference":
        return {0: reference_cost(cfg, local_steps=local_steps, wire_dtype=wire_dtype)}
    return {c.index: c for c in worker_costs(cfg, local_steps=local_steps, wire_dtype=wire_dtype)}


def fit_by_blocks(cfg: RunConfig, profile: DeviceProfile) -> list[dict[str, Any]]:
    """For every B that divides `layers`: whether the largest worker's memory fits the profile's."""
    rows = []
    for blocks in range(1, cfg.model.layers + 1):
        if cfg.model.layers % blocks:
            continue
        try:
            model = dataclasses.replace(cfg.model, blocks=blocks)
        except ConfigError:  # a shape these blocks do not fit
            continue
        largest = max(m["total"] for m in worker_memory(dataclasses.replace(cfg, model=model)))
        rows.append(
            {
                "blocks": blocks,
                "largest_worker_bytes": largest,
                "fits": largest <= profile.memory_bytes,
            }
        )
    return rows


def cost_plan(
    cfg: RunConfig, profile: DeviceProfile, *, local_steps: int, wire_dtype: str = "fp16"
) -> dict[str, Any]:
    """What `blocktrain plan` adds under a profile: each block's worker (`per_block`), the
    slowest one by its round, and the fit by the number of blocks."""
    costs = worker_costs(cfg, local_steps=local_steps, wire_dtype=wire_dtype)
    slowest = max(costs, key=lambda c: c.round_s(profile))
    table = fit_by_blocks(cfg, profile)
    fitting = [row["blocks"] for row in table if row["fits"]]
    return {
        "profile": profile.to_dict(),
        "local_steps": local_steps,
        "wire_dtype": wire_dtype,
        "batch_size": cfg.train.batch_size,
        "per_block": [c.to_dict(profile) for c in costs],
        "slowest_block": slowest.index,
        "largest_worker_bytes": max(c.memory_bytes for c in costs),
        "fits": all(c.fits(profile) for c in costs),
        "fit_by_blocks": table,
        "fewest_blocks_that_fit": min(fitting) if fitting else None,
        **route_choice(cfg, profile, local_steps=local_steps, wire_dtype=wire_dtype),
    }


COMPOSING = ("relay", "features")
"""The routes whose blocks compose (docs/model.md); `state` does not, whatever it costs."""


def route_choice(
    cfg: RunConfig, profile: DeviceProfile, *, local_steps: int, wire_dtype: str = "fp16"
) -> dict[str, Any]:
    """The same shape under each route: its largest worker's memory, its slowest round and whether
    every worker fits the profile; and the route to pick: of those that fit, the one whose slowest
    round is the shortest (relay moves streams where features pulls and reruns the blocks before
    it). None when neither fits."""
    routes: dict[str, dict[str, Any]] = {}
    for route in ("state", *COMPOSING):
        routed = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, route=route))
        costs = worker_costs(routed, local_steps=local_steps, wire_dtype=wire_dtype)
        routes[route] = {
            "largest_worker_bytes": max(c.memory_bytes for c in costs),
            "slowest_round_s": max(c.round_s(profile) for c in costs),
            "largest_flops_per_step": max(c.flops_per_step for c in costs),
            "fits": all(c.fits(profile) for c in costs),
        }
    fitting = [r for r in COMPOSING if routes[r]["fits"]]
    pick = min(fitting, key=lambda r: routes[r]["slowest_round_s"]) if fitting else None
    return {"routes": routes, "recommended_route": pick}
