"""Participation regimes (the BlockTrain design, section 5; docs/simulate.md, "Regimes").

A regime only spreads the typical figures of a device profile and the run's costs: each draw is
a factor draw / typical (the distribution's median), so any constant means "the profile's".
The deadline scales the slowest block's nominal round (`WorkerCost.round_s`), so one regime
means the same for every model shape."""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from blocktrain.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: JSON regime files only
    tomllib = None  # type: ignore[assignment]

DIST_KINDS = ("const", "lognormal", "uniform", "exponential")


@dataclass(frozen=True)
class Dist:
    """A positive distribution: `const` (value), `lognormal` (median, sigma of ln), `uniform`
    (low, high) or `exponential` (mean)."""

    kind: str = "const"
    value: float = 1.0
    median: float = 1.0
    sigma: float = 0.0
    low: float = 0.0
    high: float = 1.0
    mean: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in DIST_KINDS:
            raise ConfigError(f"distribution kind {self.kind!r} is not one of {DIST_KINDS}")
        checks = {
            "const": self.value > 0,
            "lognormal": self.median > 0 and self.sigma >= 0,
            "uniform": 0 < self.low <= self.high,
            "exponential": self.mean > 0,
        }
        if not checks[self.kind]:
            raise ConfigError(f"{self.describe()} must be positive (and low <= high)")

    @staticmethod
    def const(value: float) -> Dist:
        return Dist("const", value=value)

    @staticmethod
    def lognormal(median: float, sigma: float) -> Dist:
        return Dist("lognormal", median=median, sigma=sigma)

    def draw(self, rng: random.Random) -> float:
        if self.kind == "const":
            return self.value
        if self.kind == "lognormal":
            return self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        if self.kind == "uniform":
            return rng.uniform(self.low, self.high)
        return rng.expovariate(1.0 / self.mean)

    def factor(self, rng: random.Random) -> float:
        """A draw relative to the typical value (the regime's reading of a profile's figure)."""
        return self.draw(rng) / self.typical

    @property
    def typical(self) -> float:
        """The median (the nominal value a deadline is scaled from)."""
        if self.kind == "const":
            return self.value
        if self.kind == "lognormal":
            return self.median
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        return self.mean * math.log(2)

    def describe(self) -> str:
        if self.kind == "const":
            return f"{self.value:g}"
        if self.kind == "lognormal":
            return f"lognormal(median {self.median:g}, sigma {self.sigma:g})"
        if self.kind == "uniform":
            return f"uniform({self.low:g}, {self.high:g})"
        return f"exponential(mean {self.mean:g})"

    def to_dict(self) -> dict[str, Any]:
        keep = {
            "const": ("value",),
            "lognormal": ("median", "sigma"),
            "uniform": ("low", "high"),
            "exponential": ("mean",),
        }[self.kind]
        return {"kind": self.kind, **{k: v for k, v in asdict(self).items() if k in keep}}

    @classmethod
    def parse(cls, value: Any, where: str) -> Dist:
        """A number (constant) or a table {kind = ..., ...}."""
        if isinstance(value, int | float) and not isinstance(value, bool):
            return cls.const(float(value))
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a number or a table with `kind`, got {value!r}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
        try:
            kwargs: dict[str, Any] = {
                k: (str(v) if k == "kind" else float(v)) for k, v in value.items()
            }
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class Regime:
    """How virtual workers behave around a device profile's figures (docs/simulate.md)."""

    name: str
    step_s: Dist = field(default_factory=lambda: Dist.const(1.0))  # per worker and round
    speed: Dist = field(default_factory=lambda: Dist.const(1.0))  # once per worker
    latency_s: Dist = field(default_factory=lambda: Dist.const(1.0))  # per message
    # once per worker, on both directions (the name keeps the files' older unit)
    bandwidth_MBps: Dist = field(default_factory=lambda: Dist.const(1.0))
    dropout: float = 0.0
    deadline: float = 10.0  # x the slowest block's nominal round
    deadline_s: float | None = None  # overrides `deadline`
    description: str = ""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"regime name {self.name!r} must be letters, digits, - or _")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"regime {self.name}: dropout = {self.dropout} must lie in [0, 1)")
        if not self.deadline > 0:
            raise ConfigError(f"regime {self.name}: deadline = {self.deadline} must be positive")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ConfigError(f"regime {self.name}: deadline_s must be positive")

    def deadline_for(self, nominal_round_s: float) -> float:
        """The deadline of a round whose slowest block's nominal round takes `nominal_round_s`."""
        if self.deadline_s is not None:
            return self.deadline_s
        return self.deadline * nominal_round_s

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "description": self.description}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Dist):
                out[f.name] = value.to_dict()
            elif f.name not in ("name", "description"):
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "regime") -> Regime:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}"
            )
        if "name" not in data:
            raise ConfigError(f"{where}: a regime needs a `name`")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in ("step_s", "speed", "latency_s", "bandwidth_MBps"):
                kwargs[key] = Dist.parse(value, f"{where}: {key}")
            elif key in ("dropout", "deadline", "deadline_s"):
                if value is not None and (
                    isinstance(value, bool) or not isinstance(value, int | float)
                ):
                    raise ConfigError(f"{where}: {key} must be a number, got {value!r}")
                kwargs[key] = None if value is None else float(value)
            else:
                kwargs[key] = str(value)
        return cls(**kwargs)


REGIMES: dict[str, Regime] = {
    "lockstep": Regime(
        "lockstep",
        description="every update arrives: identical workers, a deadline that never binds",
    ),
    "mild": Regime(
        "mild",
        step_s=Dist.lognormal(1.0, 0.15),
        speed=Dist.lognormal(1.0, 0.1),
        latency_s=Dist.lognormal(1.0, 0.5),
        bandwidth_MBps=Dist.lognormal(1.0, 0.5),
        dropout=0.03,
        deadline=1.5,
        description="a shared cluster or good home links: about 90% of updates in time",
    ),
    "wan": Regime(
        "wan",
        step_s=Dist.lognormal(1.0, 0.45),
        speed=Dist.lognormal(1.0, 0.2),
        latency_s=Dist.lognormal(1.0, 0.8),
        bandwidth_MBps=Dist.lognormal(1.0, 0.8),
        dropout=0.12,
        deadline=0.9,
        description="consumer machines over the internet: about 42% of updates in time",
    ),
}
"""The seed's three regimes, calibrated with `--timing-only` (their recalibrations:
docs/simulate.md, "Regimes")."""


def load_regime(spec: str) -> Regime:
    """A named regime, or a JSON/TOML file holding one."""
    if spec in REGIMES:
        return REGIMES[spec]
    path = Path(spec)
    if path.suffix not in (".json", ".toml"):
        raise ConfigError(
            f"unknown regime {spec!r}: use one of {', '.join(REGIMES)} or a .json/.toml file"
        )
    if not path.is_file():
        raise ConfigError(f"regime file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".toml":
            if tomllib is None:
                raise ConfigError("TOML regime files need Python 3.11+; write the regime as JSON")
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"regime file {path} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"regime file {path} must hold one table (object)")
    data.setdefault("name", path.stem)
    return Regime.from_dict(data, str(path))


def parse_regimes(text: str) -> list[Regime]:
    """`lockstep,mild,wan` (names or files), in order, without repeats."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise ConfigError("--regime needs at least one regime")
    regimes = [load_regime(s) for s in items]
    names = [r.name for r in regimes]
    if len(set(names)) != len(names):
        raise ConfigError(f"regime names repeat: {', '.join(names)}")
    return regimes
