"""Logical shapes: memory planning for models far larger than this machine, and throughput runs
on random weights of a scaled-down version (docs/serving.md, "Logical shapes"). Parameters are
counted by building the modules on the meta device: exactly this code's count. A SPEC is a name,
`KEY=VALUE,...` over the model config, or a name with overrides (`seed-75b,span=16`).
"""

from __future__ import annotations

import dataclasses
import math
import time
import typing
from typing import Any

import torch

from blocktrain.config import ModelConfig, RunConfig
from blocktrain.errors import ConfigError
from blocktrain.model import Block, BlockStack, Reference, Sampling, SigmaSchedule, generate
from blocktrain.model import stack_denoiser as _stack_denoiser
from blocktrain.model.pipeline import KVCache, split_reference
from blocktrain.training.costs import TRAINED_BYTES, worker_memory

GIB = 1024**3
FP16_BYTES = 2
FP32_BYTES = 4
# A worker training one block in fp32 with AdamW holds per parameter: the weight, its gradient
# and two moments (activations come on top and depend on the batch): training/costs.py's.
TRAIN_BYTES_PER_PARAM = TRAINED_BYTES

NAMED_SHAPES: dict[str, dict[str, int]] = {
    # The seed served "up to a 75.80B-parameter logical fp16 shape" on three hosts. This code's
    # block has 12 d^2 + 6 d * noise_dim (+ norms) parameters per layer: 3 blocks of 11 layers at
    # d = 13696 (107 heads of 128) count 75,801,420,672 parameters, 75.80B.
    "seed-75b": {
        "d_model": 13696,
        "n_heads": 107,
        "layers": 33,
        "blocks": 3,
        "seq_len": 1024,
        "span": 64,
    },
}
ALIASES = {
    "d": "d_model",
    "heads": "n_heads",
    "seq": "seq_len",
    "t": "seq_len",
    "k": "span",
    "mlp": "mlp_ratio",
}
SHAPE_DEFAULTS = {"seq_len": 1024, "span": 64}


def _default_heads(d: int) -> int:
    """Heads of width 128 where d allows it, else 64, else the most heads of even width."""
    for width in (128, 64):
        if d % width == 0:
            return d // width
    return max(h for h in range(1, d + 1) if d % h == 0 and (d // h) % 2 == 0)


def parse_shape(spec: str) -> tuple[str, ModelConfig]:
    """-> (name, ModelConfig). Unknown names, keys and bad values are ConfigErrors."""
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise ConfigError("--shape needs a named shape or KEY=VALUE,...")
    name = "custom"
    values: dict[str, Any] = dict(SHAPE_DEFAULTS)
    if "=" not in items[0]:
        name = items.pop(0)
        if name not in NAMED_SHAPES:
            raise ConfigError(
                f"unknown shape {name!r}; named shapes: {', '.join(NAMED_SHAPES)}"
                " (or give KEY=VALUE,... such as layers=12,d=768,blocks=3)"
            )
        values.update(NAMED_SHAPES[name])
    hints = typing.get_type_hints(ModelConfig)
    given: set[str] = set()
    for item in items:
        key, sep, text = item.partition("=")
        key = ALIASES.get(key.strip().lower(), key.strip())
        if not sep or key not in hints:
            raise ConfigError(
                f"--shape {item!r}: expected KEY=VALUE with KEY one of "
                f"{', '.join(sorted(set(ALIASES) | set(hints)))}"
            )
        if key == "route":  # state, features or relay (checked by ModelConfig)
            values[key] = text.strip()
            given.add(key)
            continue
        typ = int if hints[key] is int else float if hints[key] is float else None
        if typ is None:
            raise ConfigError(f"--shape {key} cannot be set here; use --preset/--set")
        try:
            values[key] = typ(float(text)) if typ is int and float(text).is_integer() else typ(text)
        except ValueError:
            raise ConfigError(f"--shape {item!r}: expected a number") from None
        given.add(key)
    if "d_model" in given and "n_heads" not in given:
        values["n_heads"] = _default_heads(int(values["d_model"]))
    if "n_heads" not in values:
        values["n_heads"] = _default_heads(int(values.get("d_model", ModelConfig.d_model)))
    if "span" in values and "seq_len" in values and values["seq_len"] % values["span"]:
        raise ConfigError(f"--shape: span {values['span']} must divide seq_len {values['seq_len']}")
    return name, ModelConfig(**values)


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def count_params(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters per block, parameters of the reference), on the meta device."""
    with torch.device("meta"):
        return _count(Block(cfg)), _count(Reference(cfg))


def host_blocks(blocks: int, hosts: int) -> list[list[int]]:
    """Contiguous blocks per host, as even as possible (the chain visits them in order)."""
    if not 1 <= hosts <= blocks:
        raise ConfigError(f"--hosts {hosts} must lie in 1..{blocks} (one block at least each)")
    out, start = [], 0
    for h in range(hosts):
        n = blocks // hosts + (1 if h < blocks % hosts else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def shape_run(cfg: ModelConfig) -> RunConfig:
    """A shape as a run: its model, the default training settings (batch 32)."""
    return RunConfig(preset="shape", model=cfg)


def shape_plan(name: str, cfg: ModelConfig, hosts: int | None = None) -> dict[str, Any]:
    """Parameters, fp16 weight bytes per host and the largest worker's training memory of a
    shape (`training.costs.worker_memory`: under `route = features` the last block's worker,
    which also holds the clean streams of the blocks before it, frozen in fp16), and the state
    bytes per hop."""
    per_block, reference = count_params(cfg)
    total = per_block * cfg.blocks
    split = host_blocks(cfg.blocks, hosts or cfg.blocks)
    table = 256 * cfg.d_model  # the frozen target table, which every host and worker holds
    features = cfg.reads_upstream  # a hop carries the clean stream under features and relay
    worker = max(worker_memory(shape_run(cfg)), key=lambda memory: memory["total"])
    context = cfg.seq_len - cfg.span  # the most context a sweep carries
    per_stage_layers = cfg.layers // cfg.blocks
    return {
        "shape": name,
        "model": dataclasses.asdict(cfg),
        "layers_per_block": cfg.layers_per_block,
        "params_per_block": per_block,
        "params_total": total,
        "params_total_billions": round(total / 1e9, 2),
        "reference_params": reference,
        "hosts": len(split),
        "blocks_per_host": split,
        "weight_bytes_fp16_per_host": [(per_block * len(b) + table) * FP16_BYTES for b in split],
        "weight_bytes_fp16_total": total * FP16_BYTES,
        "worker_training_bytes": worker,
        "full_model_training_bytes": total * sum(TRAIN_BYTES_PER_PARAM.values()),
        "one_sweep_state_bytes_per_hop": {
            "fp32": cfg.span * cfg.d_model * FP32_BYTES,
            "fp16": cfg.span * cfg.d_model * FP16_BYTES,
        },
        # route = features: the previous block's clean output over the context (`u`), at T - K
        "one_sweep_upstream_bytes_per_hop": {
            "fp32": context * cfg.d_model * FP32_BYTES * features,
            "fp16": context * cfg.d_model * FP16_BYTES * features,
        },
        "ar_state_bytes_per_hop_per_byte": {
            "fp32": cfg.d_model * FP32_BYTES,
            "fp16": cfg.d_model * FP16_BYTES,
        },
        "ar_kv_cache_bytes_fp16_per_stage_per_sequence": 2
        * per_stage_layers
        * cfg.seq_len
        * cfg.d_model
        * FP16_BYTES,
    }


def scale_shape(cfg: ModelConfig, width_divisor: int) -> ModelConfig:
    """The same chain (blocks, layers, T, K) at 1/width_divisor of the width, keeping the head
    width where possible: what a throughput run on this machine can hold."""
    if width_divisor < 1:
        raise ConfigError(f"--set scale={width_divisor} must be >= 1")
    if width_divisor == 1:
        return cfg
    head = cfg.head_dim if cfg.head_dim % 2 == 0 else 64
    d = max(head, round(cfg.d_model / width_divisor / head) * head)
    return dataclasses.replace(
        cfg, d_model=d, n_heads=d // head, noise_dim=min(cfg.noise_dim, d - d % 2)
    )


def auto_scale(cfg: ModelConfig, max_params: int = 60_000_000) -> int:
    """The smallest power-of-two width divisor that brings the whole model under max_params."""
    divisor = 1
    while True:
        scaled = scale_shape(cfg, divisor)
        if count_params(scaled)[0] * scaled.blocks <= max_params or scaled.d_model <= 64:
            return divisor
        divisor *= 2


@torch.no_grad()
def measure_throughput(
    cfg: ModelConfig,
    *,
    prompt_bytes: int = 64,
    output_bytes: int = 64,
    seed: int = 0,
    repeats: int = 2,
) -> dict[str, Any]:
    """Bytes per second of one-sweep generation and of the KV-cached autoregressive stage
    pipeline, in this process on random weights (no network): the compute side of serving."""
    if prompt_bytes + output_bytes > cfg.seq_len:
        raise ConfigError(
            f"prompt ({prompt_bytes}) + output ({output_bytes}) bytes exceed the "
            f"shape's context T = {cfg.seq_len}"
        )
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 256, (1, prompt_bytes), generator=gen)
    stack = BlockStack(cfg, seed).eval()
    grid = SigmaSchedule.from_config(cfg).sampler_grid(1)

    def one_sweep() -> None:
        generate(
            _stack_denoiser(stack),
            prompt,
            output_bytes,
            grid=grid,
            targets=stack.targets,
            span=cfg.span,
            max_context=cfg.seq_len - cfg.span,
            sampling=Sampling(),
            generator=torch.Generator().manual_seed(seed),
        )

    ref = Reference(cfg).eval()
    stages = split_reference(ref, cfg.blocks)
    del ref

    def autoregressive() -> None:
        caches = [KVCache() for _ in stages]
        h: torch.Tensor = prompt
        g = torch.Generator().manual_seed(seed)
        for _ in range(output_bytes):
            for stage, cache in zip(stages, caches, strict=True):
                h = stage(h, cache)
            h = torch.multinomial(h[:, -1].softmax(-1), 1, generator=g)  # (1, 1)

    def best(fn: typing.Callable[[], None]) -> float:
        fn()  # warm up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    t_sweep, t_ar = best(one_sweep), best(autoregressive)
    sweeps = math.ceil(output_bytes / cfg.span)
    return {
        "model": dataclasses.asdict(cfg),
        "params_total": count_params(cfg)[0] * cfg.blocks,
        "prompt_bytes": prompt_bytes,
        "output_bytes": output_bytes,
        "one_sweep_seconds": t_sweep,
        "one_sweep_bytes_per_s": output_bytes / t_sweep,
        "sweeps": sweeps,
        "ar_seconds": t_ar,
        "ar_bytes_per_s": output_bytes / t_ar,
        "ratio": t_ar / t_sweep,
        "torch_threads": torch.get_num_threads(),
    }


def format_plan(plan: dict[str, Any]) -> list[str]:
    m = plan["model"]
    w = plan["worker_training_bytes"]
    lines = [
        f"shape {plan['shape']}: {m['blocks']} blocks x {plan['layers_per_block']} layers, "
        f"d = {m['d_model']} ({m['n_heads']} heads), T = {m['seq_len']}, K = {m['span']}, "
        f"route {m['route']}",
        f"  params            {plan['params_total']:,} ({plan['params_total_billions']:.2f}B; "
        f"per block {plan['params_per_block']:,}; reference {plan['reference_params']:,})",
    ]
    for h, (blocks, size) in enumerate(
        zip(plan["blocks_per_host"], plan["weight_bytes_fp16_per_host"], strict=True)
    ):
        lines.append(f"  host {h}            blocks {blocks}: {size / GIB:.2f} GiB of fp16 weights")
    upstream = (
        f" + the upstream clean streams {w['upstream_fp16'] / GIB:.2f} (fp16, the last block's)"
        if w["upstream_fp16"]
        else ""
    )
    relay = w["relay_stream_in"] + w["relay_stream_out"] + w["relay_features_fp32"]
    if relay:
        upstream += f" + one step of the relayed streams {relay / GIB:.2f}"
    lines.append(
        f"  worker training   {w['total'] / GIB:.2f} GiB for one block (fp32 weights "
        f"{w['weights'] / GIB:.2f} + grads {w['grads'] / GIB:.2f} + AdamW "
        f"{w['adamw_moments'] / GIB:.2f}{upstream}; activations not counted)"
    )
    lines.append(
        f"  full model        {plan['full_model_training_bytes'] / GIB:.2f} GiB to "
        "train in one place"
    )
    return lines
