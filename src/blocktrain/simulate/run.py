"""Several regimes side by side: the same model, data, seeds and settings, one `Simulation` each
from the same version 0 and fresh workers, then the records, the final weights and a plot."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from blocktrain.config import RunConfig
from blocktrain.data import ByteSource
from blocktrain.errors import ConfigError
from blocktrain.fsutil import atomic_write_bytes
from blocktrain.protocol.core.bounds import derived_settings, largest_block
from blocktrain.protocol.core.local_trainer import UNITS, LocalTrainer
from blocktrain.relaystream import Shape
from blocktrain.simulate.attacks import Attack, Hostiles
from blocktrain.simulate.engine import Simulation
from blocktrain.simulate.regimes import Regime
from blocktrain.simulate.workers import TimingOnlyTrainer
from blocktrain.training import EvalSettings
from blocktrain.training import checkpoint as ckpt
from blocktrain.training.costs import stream_shape, unit_costs
from blocktrain.training.local import (
    evaluate_units,
    initial_units,
    local_trainer,
    reference_config,
)
from blocktrain.training.probe import BlockProbe
from blocktrain.training.profiles import PROFILES, DeviceProfile
from blocktrain.training.step import stream_seed

PROBE_SECRET_SALT = 11  # the simulated probe's secret: from the run seed and this salt

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class SimSpec:
    """What every regime of one invocation shares."""

    cfg: RunConfig
    workers: int
    rounds: int
    protocol: dict[str, Any]  # AggregatorSettings overrides
    seed: int = 0
    eval_bytes: int = 4096
    eval_every: int = 1
    final_sweeps: int = 16  # M for the final model's sampler CE
    final_bytes: int = 16384  # more than per round: the final figure decides
    timing_only: bool = False
    attack: Attack | None = None
    unit: str = "block"  # or the end-to-end `reference` as the run's one unit (DiLoCo)
    slowdown: dict[int, float] = dataclasses.field(default_factory=dict)  # worker -> factor
    profile: DeviceProfile = dataclasses.field(default_factory=lambda: PROFILES["cpu"])

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ConfigError(f"--set unit={self.unit}: choose one of {', '.join(UNITS)}")
        if self.unit == "reference":  # the reference has no blocks
            object.__setattr__(self, "cfg", reference_config(self.cfg))
        for name in (
            "workers",
            "rounds",
            "eval_bytes",
            "eval_every",
            "final_sweeps",
            "final_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        if self.attack is not None and self.attack.trains and self.timing_only:
            raise ConfigError(f"--set attack={self.attack.kind} trains: not with --timing-only")
        for worker, factor in self.slowdown.items():
            if not 0 <= worker < self.workers or not factor > 0:
                raise ConfigError(f"slowdown {worker}: {factor}: no such worker, or not positive")
        if self.workers < self.cfg.model.blocks:
            raise ConfigError(
                f"--workers {self.workers} leaves blocks without a replica: the model has "
                f"{self.cfg.model.blocks} blocks"
            )


def simulate(
    spec: SimSpec,
    regimes: list[Regime],
    train: ByteSource | None,
    valid: ByteSource | None,
    *,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[dict[str, Any], dict[str, dict[int, Tensors]]]:
    """Run every regime; returns the report and each regime's final weights per block."""
    cfg = spec.cfg
    initial = initial_units(cfg, spec.unit)
    settings = derived_settings(
        cfg,
        {**spec.protocol, "max_rounds": spec.rounds, "n_workers": spec.workers},
        largest_block(initial),
    )
    costs = unit_costs(
        cfg, spec.unit, local_steps=settings.local_steps, wire_dtype=settings.wire_dtype
    )
    evaluate: Callable[[dict[int, Tensors]], float] | None = None
    probe: BlockProbe | None = None
    probe_skip = max(spec.eval_bytes, spec.final_bytes)
    initial_ce: float | None = None
    if not spec.timing_only:
        if train is None or valid is None:
            raise ConfigError("a simulation that trains needs the train and valid splits")
        windows = valid.windows(cfg.model.seq_len, spec.eval_bytes)
        final_windows = valid.windows(cfg.model.seq_len, spec.final_bytes)

        def evaluate(blocks: dict[int, Tensors]) -> float:
            """The per-round CE: one sweep from noise (a reference unit's exact CE)."""
            once = EvalSettings(sweeps=1, seed=cfg.seed, oracle=False)
            return float(evaluate_units(cfg, spec.unit, blocks, windows, once)["from_noise_ce"])

        initial_ce = evaluate(initial)
        if settings.effect_probe == "on":  # its slice starts after the evaluation's windows
            if spec.unit != "block":
                raise ConfigError(
                    "--set unit=reference simulates with --effect-probe off: the probe judges blocks"
                )
            probe = BlockProbe(  # a secret of the run's seed: a simulation is reproducible
                cfg,
                valid,
                skip_bytes=probe_skip,
                secret=stream_seed(cfg.seed, 0, 0, PROBE_SECRET_SALT),
            )
    report: dict[str, Any] = {
        "config": cfg.to_dict(),
        "unit": spec.unit,
        "workers": spec.workers,
        "rounds": spec.rounds,
        "seed": spec.seed,
        "timing_only": spec.timing_only,
        "protocol": settings.to_dict(),
        "eval": {
            "bytes": spec.eval_bytes,
            "every": spec.eval_every,
            "sweeps": 1,
            "final_sweeps": spec.final_sweeps,
            "final_bytes": spec.final_bytes,
        },
        "attack": None if spec.attack is None else dataclasses.asdict(spec.attack),
        "slowdown": {str(w): f for w, f in sorted(spec.slowdown.items())},
        "profile": spec.profile.to_dict(),
        "costs": [c.to_dict(spec.profile) for _, c in sorted(costs.items())],
        "regimes": {},
    }
    weights: dict[str, dict[int, Tensors]] = {}
    for regime in regimes:
        if "deadline_s" in spec.protocol:  # --deadline pins every regime's deadline
            regime = dataclasses.replace(regime, deadline_s=float(spec.protocol["deadline_s"]))
        closed = [0]

        def on_round(
            _block: int, _round: int, name: str = regime.name, closed: list[int] = closed
        ) -> None:
            closed[0] += 1
            if progress is not None:
                progress(name, closed[0], spec.rounds * cfg.model.blocks)

        sim = Simulation(
            regime,
            settings,
            initial,
            trainer_factory(spec, initial, train),
            spec.workers,
            seed=spec.seed,
            costs=costs,
            profile=spec.profile,
            evaluate=evaluate,
            eval_every=spec.eval_every,
            on_round=on_round,
            probe=probe,
            hostiles=None
            if spec.attack is None
            else Hostiles(
                spec.attack,
                cfg,
                settings,
                train,
                valid,
                unit=spec.unit,
                n_workers=spec.workers,
                probe_skip=probe_skip,
                seed=spec.seed,
            ),
            slowdown=spec.slowdown,
            relay=relay_shape(cfg) if spec.unit == "block" else None,
        )
        sim.run()
        summary = sim.summary()
        ces = [r["from_noise_ce"] for r in summary["rounds"] if r["from_noise_ce"] is not None]
        report["regimes"][regime.name] = {
            "participation": summary["participation"],
            "initial_ce": initial_ce,
            "final_ce": ces[-1] if ces else None,
            **summary,
            "regime": regime.to_dict(),
        }
        weights[regime.name] = {b: st.weights for b, st in sim.agg.blocks.items()}
        if evaluate is not None:
            # late from-noise CE carries the commitment penalty (the design, section 2.8): the
            # final model is also measured with the sampler CE over M sweeps
            at_end = EvalSettings(sweeps=spec.final_sweeps, seed=cfg.seed, oracle=False)
            final = evaluate_units(cfg, spec.unit, weights[regime.name], final_windows, at_end)
            report["regimes"][regime.name]["final_sampler_ce"] = float(final["sampler_ce"])
            report["regimes"][regime.name]["final_from_noise_ce"] = float(final["from_noise_ce"])
    return report, weights


def relay_shape(cfg: RunConfig) -> Shape | None:
    """Under `route = relay`, what each step of a relayed stream holds; else None."""
    if cfg.model.route != "relay":
        return None
    return stream_shape(cfg)


def trainer_factory(
    spec: SimSpec, initial: dict[int, Tensors], train: ByteSource | None
) -> Callable[[int, int], LocalTrainer]:
    """(worker id, block) -> that worker's trainer, with the data seed the aggregator gives it
    (seed * n_workers + worker id)."""
    cfg = spec.cfg

    def make(worker_id: int, block: int) -> LocalTrainer:
        if spec.timing_only:
            shapes = {k: tuple(v.shape) for k, v in initial[block].items()}
            # it pulls (and relays) what a real worker of its block does: the same bytes
            pulls = cfg.model.route == "features" and spec.unit == "block"
            upstream = list(range(block)) if pulls else []
            relay = relay_shape(cfg) if spec.unit == "block" else None
            return TimingOnlyTrainer(
                shapes,
                cfg.train.batch_size * cfg.model.seq_len,
                upstream,
                block=block,
                relay=relay,
                blocks=cfg.model.blocks,
                relay_every=cfg.train.relay_every,
            )
        assert train is not None
        return local_trainer(
            cfg, spec.unit, block, train, data_seed=cfg.seed * spec.workers + worker_id
        )

    return make


def write_outputs(
    out: Path, report: dict[str, Any], weights: dict[str, dict[int, Tensors]]
) -> list[Path]:
    """OUT/simulate.json, OUT/REGIME/rounds.jsonl and weights.safetensors, OUT/ce.png."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "simulate.json"]
    atomic_write_bytes(written[0], (json.dumps(report, indent=2) + "\n").encode())
    for name, result in report["regimes"].items():
        folder = out / name
        folder.mkdir(exist_ok=True)
        lines = "".join(json.dumps(r) + "\n" for r in result["rounds"])
        atomic_write_bytes(folder / "rounds.jsonl", lines.encode())
        tensors = {
            f"block.{b}.{k}": v.contiguous()
            for b, block in sorted(weights[name].items())
            for k, v in block.items()
        }
        ckpt.atomic_save_tensors(folder / "weights.safetensors", tensors, {"regime": name})
        written += [folder / "rounds.jsonl", folder / "weights.safetensors"]
    if not report["timing_only"]:
        written.append(plot(report, out / "ce.png"))
    return written


def plot(report: dict[str, Any], path: Path) -> Path:
    """From-noise CE against rounds and against virtual time, one line per regime."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_round, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for name, result in report["regimes"].items():
        points = [(-1, 0.0, result["initial_ce"])] + [
            (r["round"], r["time"], r["from_noise_ce"])
            for r in result["rounds"]
            if r["from_noise_ce"] is not None
        ]
        label = f"{name} (participation {result['participation']:.0%})"
        by_round.plot([p[0] + 1 for p in points], [p[2] for p in points], marker=".", label=label)
        by_time.plot([p[1] for p in points], [p[2] for p in points], marker=".", label=label)
    by_round.set_xlabel("rounds closed")
    by_time.set_xlabel("virtual time (s)")
    by_round.set_ylabel("from-noise CE (nats/byte, validation)")
    for ax in (by_round, by_time):
        ax.grid(alpha=0.3)
    by_round.legend()
    cfg = report["config"]["model"]
    fig.suptitle(
        f"blocktrain simulate: {report['workers']} workers, d={cfg['d_model']}, "
        f"{cfg['blocks']} blocks, H={report['protocol']['local_steps']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(report: dict[str, Any]) -> str:
    """A markdown table of the regimes."""
    rows = [
        "| regime | deadline (virtual s) | participation | initial CE | final CE | "
        "final sampler CE | virtual time (s) | refused | dropped | train share of wall |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for name, r in report["regimes"].items():
        refused = ", ".join(f"{k} {v}" for k, v in r["updates"]["refused"].items()) or "none"
        share = "-" if report["timing_only"] else f"{r['compute']['train_fraction']:.1%}"
        rows.append(
            f"| {name} | {r['deadline_s']:.2f} | {r['participation']:.1%} | "
            f"{_num(r['initial_ce'])} | {_num(r['final_ce'])} | "
            f"{_num(r.get('final_sampler_ce'))} | {r['virtual_time_s']:.1f} | "
            f"{refused} | {r['updates']['dropped']} | {share} |"
        )
    rows.append("")
    rows.append(describe_costs(report))
    return "\n".join(rows)


def describe_costs(report: dict[str, Any]) -> str:
    """One line: the profile and each unit's nominal seconds a step (what the clock charges)."""
    steps = ", ".join(
        (f"block {c['block']}" if "block" in c else "reference") + f" {c['step_s']:.3g} s"
        for c in report["costs"]
    )
    return f"profile {report['profile']['name']}: a local step takes (nominal) {steps}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
