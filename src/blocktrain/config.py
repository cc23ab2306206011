"""Typed, frozen configuration: the model and its training. A run is described completely by a
`RunConfig`, saved as `RUN_DIR/config.json` next to the weights; variants come from
`dataclasses.replace` or `apply_overrides` (the CLI's `--set KEY=VALUE`)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Union

from blocktrain.errors import ConfigError

VOCAB_SIZE = 256  # byte values; the vocabulary is fixed
RELAY_BITS = (8, 4, 2)
"""The bits a relayed feature may take (`relay_bits`, relaystream.py)."""
ROUTES = ("state", "features", "relay")
INTERVAL_ORDERS = ("forward", "reversed")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the block stack and of its end-to-end reference (docs/model.md)."""

    d_model: int = 128
    """Width of every block (and of the reference)."""
    n_heads: int = 4
    """Attention heads per layer; must divide d_model."""
    layers: int = 3
    """Total transformer layers: the reference's depth, split evenly over the blocks."""
    blocks: int = 3
    """B, the number of independently trained blocks; must divide `layers`."""
    seq_len: int = 64
    """T, bytes per training sequence (the context window)."""
    span: int = 1
    """K, bytes denoised together; K = 1 is next-byte prediction. Must divide seq_len."""
    mlp_ratio: int = 4
    """Hidden width of each MLP, as a multiple of d_model."""
    noise_dim: int = 128
    """Width of the noise-level embedding that drives the adaLN modulations."""
    sigma_min: float = 1.0
    """Lowest noise level. Low values let a block read the answer off z (target leakage)."""
    sigma_max: float = 10.0
    """Highest noise level; sampling starts from sigma_max * N(0, I)."""
    p_mean: float = -1.2
    """Mean of ln(sigma) in the log-normal that partitions the noise range."""
    p_std: float = 1.2
    """Standard deviation of ln(sigma) in that log-normal."""
    sigma_data: float | None = None
    """EDM sigma_data; None means 1/sqrt(d_model), the unit-norm target table's real per-coordinate
    scale (docs/model.md, the table of choices: with 0.5, c_skip * z injects noise as large as the
    signal at sigma = 1)."""
    overlap: float = 0.1
    """gamma: each block also trains this fraction (in log-sigma) beyond its interval's ends."""
    z_prev_byte: bool = True
    """Add to each noisy token the clean embedding of the last byte it may see (docs/model.md,
    "A block")."""
    gates_open: bool = True
    """adaLN gates act as (1 + gate), so residual branches start open instead of shut."""
    aux_weight: float = 1.0
    """Weight of the block-local next-byte loss on the clean stream (0 turns it off)."""
    route: str = "relay"
    """What block b+1 reads from block b, and how its worker gets it (docs/model.md, "Blocks that
    compose" and "Relayed streams"): `relay` and `features` also block b's clean stream, which
    block b+1's continues with no gradient into block b; `relay` relays it, so a worker holds and
    runs its block only, `features` reruns blocks 0..b each step (memory and compute grow with b).
    `state`: only z (DiffusionBlocks' original; a stack is then no better than one block)."""
    intervals: str = "forward"
    """Which block owns which noise: `forward`, block 0 the highest interval (DiffusionBlocks);
    `reversed`, the last block the highest, so that under `route = features` the block reading the
    deepest features trains where z carries nothing (docs/model.md). The sampler visits the
    highest noise first."""

    def __post_init__(self) -> None:
        _check(self.d_model > 0, "d_model", self.d_model, "must be positive")
        _check(self.n_heads > 0, "n_heads", self.n_heads, "must be positive")
        _check(
            self.d_model % self.n_heads == 0,
            "n_heads",
            self.n_heads,
            f"must divide d_model = {self.d_model}",
        )
        _check(
            (self.d_model // self.n_heads) % 2 == 0,
            "n_heads",
            self.n_heads,
            "must leave an even head width for rotary positions",
        )
        _check(self.layers > 0, "layers", self.layers, "must be positive")
        _check(self.blocks > 0, "blocks", self.blocks, "must be positive")
        _check(
            self.blocks <= self.layers,
            "blocks",
            self.blocks,
            f"cannot exceed layers = {self.layers} (each block needs at least one layer)",
        )
        _check(
            self.layers % self.blocks == 0,
            "layers",
            self.layers,
            f"must be a multiple of blocks = {self.blocks}",
        )
        _check(self.seq_len > 1, "seq_len", self.seq_len, "must be at least 2")
        _check(self.span > 0, "span", self.span, "must be positive")
        _check(
            self.seq_len % self.span == 0,
            "span",
            self.span,
            f"must divide seq_len = {self.seq_len} (K must divide T)",
        )
        _check(self.mlp_ratio > 0, "mlp_ratio", self.mlp_ratio, "must be positive")
        _check(
            self.noise_dim > 0 and self.noise_dim % 2 == 0,
            "noise_dim",
            self.noise_dim,
            "must be a positive even number",
        )
        _check(self.sigma_min > 0, "sigma_min", self.sigma_min, "must be > 0")
        _check(
            self.sigma_max > self.sigma_min,
            "sigma_max",
            self.sigma_max,
            f"must exceed sigma_min = {self.sigma_min}",
        )
        _check(self.p_std > 0, "p_std", self.p_std, "must be positive")
        _check(
            self.sigma_data is None or self.sigma_data > 0,
            "sigma_data",
            self.sigma_data,
            "must be positive (or none for 1/sqrt(d_model))",
        )
        _check(0 <= self.overlap < 1, "overlap", self.overlap, "must lie in [0, 1)")
        _check(self.aux_weight >= 0, "aux_weight", self.aux_weight, "must be >= 0")
        for name, ok in (
            ("route", ROUTES),
            ("intervals", INTERVAL_ORDERS),
        ):
            value = getattr(self, name)
            _check(value in ok, name, value, f"must be one of {', '.join(ok)}")

    @property
    def reads_upstream(self) -> bool:
        """Whether block b > 0 reads block b-1's clean stream (`features` and `relay`: one model,
        two ways to train it), or only z (`state`)."""
        return self.route != "state"

    @property
    def layers_per_block(self) -> int:
        return self.layers // self.blocks

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def sigma_data_value(self) -> float:
        return self.sigma_data if self.sigma_data is not None else 1.0 / math.sqrt(self.d_model)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, evaluation and checkpointing of one run."""

    steps: int = 300
    """Optimizer updates per block (and for the reference)."""
    batch_size: int = 32
    """Sequences per update."""
    lr: float = 2e-3
    """Peak AdamW learning rate."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 30
    """Linear warmup from 0 to lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (not on norms, biases or embeddings)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    grad_clip: float = 1.0
    """Clip each block's gradient to this global norm (0 turns clipping off)."""
    eval_every: int = 100
    """Evaluate on the validation split every this many steps (0: only at the end)."""
    eval_bytes: int = 8192
    """Validation bytes per periodic evaluation."""
    eval_sweeps: int = 4
    """Sampler sweeps M per periodic evaluation."""
    checkpoint_every: int = 100
    """Write a resumable checkpoint every this many steps (and always at the end)."""
    log_every: int = 10
    """Append training metrics to metrics.jsonl every this many steps."""
    device: str = "auto"
    """'cpu', 'cuda', or 'auto' (cuda when available)."""
    precision: str = "fp32"
    """'fp32', or 'bf16' autocast (on GPUs that support it)."""
    threads: int = 0
    """CPU threads for torch (0: leave torch's default)."""
    relay_bits: int = 8
    """`route = relay`: the bits of each relayed feature, 8, 4 or 2 (relaystream.py)."""
    relay_every: int = 1
    """`route = relay`: relay one local step in this many; block b+1 trains on each relayed batch
    this many times (a stream this many times smaller)."""

    def __post_init__(self) -> None:
        _check(
            self.relay_bits in RELAY_BITS,
            "relay_bits",
            self.relay_bits,
            f"must be one of {RELAY_BITS}",
        )
        _check(self.relay_every >= 1, "relay_every", self.relay_every, "must be at least 1")
        for name in ("steps", "batch_size"):
            _check(getattr(self, name) > 0, name, getattr(self, name), "must be positive")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "log_every", "threads"):
            _check(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        _check(self.lr > 0, "lr", self.lr, "must be positive")
        _check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "must lie in [0, 1]")
        _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        _check(0 <= self.beta1 < 1, "beta1", self.beta1, "must lie in [0, 1)")
        _check(0 <= self.beta2 < 1, "beta2", self.beta2, "must lie in [0, 1)")
        _check(self.grad_clip >= 0, "grad_clip", self.grad_clip, "must be >= 0")
        _check(self.eval_bytes > 0, "eval_bytes", self.eval_bytes, "must be positive")
        _check(self.eval_sweeps > 0, "eval_sweeps", self.eval_sweeps, "must be positive")
        _check(
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
            "device",
            self.device,
            "must be auto, cpu or cuda[:N]",
        )
        _check(
            self.precision in ("fp32", "bf16"), "precision", self.precision, "must be fp32 or bf16"
        )


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run; saved as RUN_DIR/config.json."""

    preset: str = "tiny"
    """The preset this run started from (for the record)."""
    seed: int = 0
    """Seeds the target table, every block's initialisation, the batches and the noise."""
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        try:
            model = ModelConfig(**_legacy_model(data.get("model", {})))
            train = TrainConfig(**data.get("train", {}))
            return cls(
                preset=str(data.get("preset", "custom")),
                seed=int(data.get("seed", 0)),
                model=model,
                train=train,
            )
        except TypeError as exc:  # an unknown or missing key
            raise ConfigError(f"config does not match this version of blocktrain: {exc}") from exc


_GAUSSIAN = {"process": "gaussian", "mask_loss": "mean", "mask_suffix_share": 0.5}
"""The keys of the masked span process (removed; bb9b624 holds it) as a Gaussian run saved them."""


def _legacy_model(model: Any) -> Any:
    """A saved model config as this version reads it: one written before `route` existed
    passed only z between its blocks (`route = state`), whatever today's default is; one
    written while the masked span process existed names its Gaussian process, which it drops."""
    if not isinstance(model, dict) or not model:
        return model
    if model.get("process", "gaussian") != "gaussian":
        raise ConfigError(
            f"process = {model['process']} was removed (docs/decisions.md); bb9b624 serves it"
        )
    model = {k: v for k, v in model.items() if k not in _GAUSSIAN}
    if "route" not in model:
        return {**model, "route": "state"}
    return model


def parse_blocks(text: str, flag: str = "--blocks") -> tuple[int, ...]:
    """The block indices of `--blocks` (train's `--block`): distinct non-negative integers separated
    by commas, sorted ("1, 2" -> (1, 2)); empty items are skipped; a ConfigError naming `flag`
    otherwise. Whether each is a block of the run is the caller's check."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    blocks = [int(item) for item in items if re.fullmatch(r"[0-9]+", item)]
    if not items or len(blocks) != len(items) or len(set(blocks)) != len(blocks):
        raise ConfigError(
            f"{flag} {text!r}: expected distinct block indices (0, 1, ...) separated by "
            "commas, such as 0 or 1,2"
        )
    return tuple(sorted(blocks))


def _check(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise ConfigError(f"{name} = {value!r} {why}")


# --------------------------------------------------------------------------------------------
# --set KEY=VALUE
# --------------------------------------------------------------------------------------------


def settable_keys() -> dict[str, tuple[str, type]]:
    """Every key `--set` accepts, mapped to (section, python type). Keys are unique across
    sections, so `lr=...` and `train.lr=...` both work."""
    keys: dict[str, tuple[str, type]] = {"seed": ("", int)}
    for section, cls in (("model", ModelConfig), ("train", TrainConfig)):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            keys[f.name] = (section, hints[f.name])
    return keys


def unknown_key(key: str, valid: Iterable[str]) -> str:
    """The error of `--set KEY=...` with a KEY no section has: the nearest valid keys."""
    near = difflib.get_close_matches(key.split(".", 1)[-1], sorted(valid), n=3, cutoff=0.6)
    return f"unknown --set key {key!r}" + (
        f"; nearest: {', '.join(near)}" if near else "; see the command's --help for its keys"
    )


def parse_value(key: str, text: str, typ: Any) -> Any:
    optional = False
    origin = typing.get_origin(typ)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        optional, typ = True, args[0]
    if optional and text.lower() in ("none", "null", "auto"):
        return None
    try:
        if typ is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if typ is int:
            return int(float(text)) if float(text).is_integer() else int(text)
        if typ is float:
            return float(text)
        return str(text)
    except ValueError:
        raise ConfigError(f"--set {key}={text}: expected a {typ.__name__}") from None


def apply_overrides(cfg: RunConfig, items: list[str]) -> RunConfig:
    """Apply `KEY=VALUE` strings (the CLI's --set) to a config; unknown keys are errors."""
    keys = settable_keys()
    model_changes: dict[str, Any] = {}
    train_changes: dict[str, Any] = {}
    seed = cfg.seed
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        key, text = item.split("=", 1)
        key = key.strip()
        short = key.split(".", 1)[1] if key.startswith(("model.", "train.")) else key
        if short not in keys or (key != short and not key.startswith(keys[short][0] + ".")):
            raise ConfigError(unknown_key(key, keys))
        section, typ = keys[short]
        value = parse_value(key, text.strip(), typ)
        if section == "model":
            model_changes[short] = value
        elif section == "train":
            train_changes[short] = value
        else:
            seed = value
    return dataclasses.replace(
        cfg,
        seed=seed,
        model=dataclasses.replace(cfg.model, **model_changes),
        train=dataclasses.replace(cfg.train, **train_changes),
    )
