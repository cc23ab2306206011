"""Device profiles: the hardware a worker trains on, in the few figures the cost model needs
(`training/costs.py`: seconds per local step, seconds per round, whether a worker fits).

Every figure names its source in `sources`; a figure that is an assumption says "assumed" there.
The GPUs' sustained share of their peak is such an assumption (no run here measured it); the
`cpu` profile's is this repository's own measurement (benchmarks/results/throughput.json).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from blocktrain.errors import ConfigError

GIB = 1024**3
MBIT = 1e6 / 8  # bytes per second in one megabit per second

FIGURES = (  # the figures every profile sources (the keys of `DeviceProfile.sources`)
    "memory_bytes",
    "peak_flops_per_s",
    "utilisation",
    "link_down_bytes_per_s",
    "link_up_bytes_per_s",
    "latency_s",
)


@dataclass(frozen=True)
class DeviceProfile:
    """One kind of worker machine: its memory, its compute and its link."""

    name: str
    description: str
    memory_bytes: int  # what a worker's training state must fit in (GPU memory, or RAM)
    peak_flops_per_s: float  # dense, in the precision it trains in (16-bit tensor cores)
    utilisation: float  # the sustained share of the peak a step reaches (MFU)
    link_down_bytes_per_s: float
    link_up_bytes_per_s: float
    latency_s: float  # one way, to the aggregator (or to the next worker)
    sources: Mapping[str, str]  # where each figure of FIGURES comes from

    def __post_init__(self) -> None:
        for name in FIGURES:
            if not getattr(self, name) > 0:
                raise ConfigError(f"profile {self.name}: {name} must be positive")
        if not self.utilisation <= 1:
            raise ConfigError(f"profile {self.name}: utilisation must lie in (0, 1]")
        missing = [name for name in FIGURES if not self.sources.get(name)]
        if missing:
            raise ConfigError(f"profile {self.name}: no source for {', '.join(missing)}")

    @property
    def flops_per_s(self) -> float:  # the sustained rate
        return self.peak_flops_per_s * self.utilisation

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            **{name: getattr(self, name) for name in FIGURES},
            "flops_per_s": self.flops_per_s,
            "sources": dict(self.sources),
        }


_MFU = (
    "assumed 0.4: below the 46.2% model FLOPs utilisation PaLM reports for its 540B training "
    "on TPU v4 (Chowdhery et al. 2022, arXiv 2204.02311; "
    "https://leonericsson.github.io/blog/2023-08-22-palm), which a single consumer-scale worker "
    "running this code is not tuned to reach"
)
_HOME_DOWN = (
    "107.50 Mb/s: the Speedtest Global Index's global fixed-broadband download speed, July 2021 "
    "(https://www.telecompetitor.com/global-mobile-and-fixed-speeds-accelerating-u-s-not-in-top-10-globally/)"
)
_HOME_UP = (
    "44.10 Mb/s: the Speedtest Global Index's global average fixed-broadband upload speed, "
    "August 2020 (https://telecomtalk.info/india-gains-four-spots-fixed-broadband-index-drops/297716/)"
)
_HOME_LATENCY = (
    "assumed 0.05 s one way (0.1 s round trip to an aggregator on another continent); for "
    "scale, Ookla measured a 15 ms median round trip on US fixed broadband to a nearby test "
    "server in Q3 2021 (https://ooklacommain.kinsta.cloud/articles/tag/global-index-ca/page/2), "
    "a floor that a distant aggregator does not reach"
)
_HOME_LINK = {
    "link_down_bytes_per_s": _HOME_DOWN,
    "link_up_bytes_per_s": _HOME_UP,
    "latency_s": _HOME_LATENCY,
}
_THROUGHPUT = "benchmarks/results/throughput.json (python bench/throughput.py, commit fdf4bee)"
# Its row small/blocktrain: the fp32 matmul rate on the step's own shapes, and the model FLOP/s
# the step achieved (the small preset's, the larger of the two measured BlockTrain shapes).
_CPU_MATMUL = 266.3802494733969e9
_CPU_ACHIEVED = 176.38822220953318e9

PROFILES: dict[str, DeviceProfile] = {
    "consumer-gpu": DeviceProfile(
        name="consumer-gpu",
        description="an 8 GB consumer GPU (NVIDIA GeForce RTX 4060) on a home broadband link",
        memory_bytes=8 * GIB,
        peak_flops_per_s=30.23e12,
        utilisation=0.4,
        link_down_bytes_per_s=107.50 * MBIT,
        link_up_bytes_per_s=44.10 * MBIT,
        latency_s=0.05,
        sources={
            "memory_bytes": "8 GB GDDR6 (8,192 MiB), NVIDIA GeForce RTX 4060 "
            "(https://hmc-tech.com/gpu/nvidia-geforce-rtx-4060-vs-nvidia-geforce-rtx-4060)",
            "peak_flops_per_s": "30.23 TFLOPS BF16 tensor, dense, FP32 accumulate, RTX 4060 "
            "(https://hmc-tech.com/gpu/nvidia-geforce-rtx-4060-vs-nvidia-geforce-rtx-4060)",
            "utilisation": _MFU,
            **_HOME_LINK,
        },
    ),
    "datacenter-gpu": DeviceProfile(
        name="datacenter-gpu",
        description="an NVIDIA H100 SXM5 80 GB in a cloud data centre, on the instance's "
        "internet link",
        memory_bytes=80 * GIB,
        peak_flops_per_s=989.4e12,
        utilisation=0.4,
        link_down_bytes_per_s=10_000 * MBIT,
        link_up_bytes_per_s=10_000 * MBIT,
        latency_s=0.02,
        sources={
            "memory_bytes": "80 GB HBM3, H100 SXM5 (https://glennklockwood.com/garden/processors/h100)",
            "peak_flops_per_s": "989.4 TFLOPS BF16 matrix, dense, H100 SXM5 "
            "(https://glennklockwood.com/garden/processors/h100)",
            "utilisation": _MFU,
            "link_down_bytes_per_s": "10 Gbit/s: Scaleway documents internet bandwidth up to "
            "20 Gbit/s for its 2-GPU H100-SXM-2-80G instance (10 per GPU) and 10 Gbit/s for the "
            "1-GPU H100-1-80G (https://github.com/scaleway/docs-content/blob/main/pages/gpu/"
            "reference-content/gpu-instances-bandwidth-overview.mdx)",
            "link_up_bytes_per_s": "assumed equal to the download rate: that page gives one "
            "internet bandwidth per instance, not one per direction",
            "latency_s": "assumed 0.02 s one way between two data centres on one continent",
        },
    ),
    "cpu": DeviceProfile(
        name="cpu",
        description="this repository's reference machine: 2 cores of an Intel Xeon "
        "(Sapphire Rapids), fp32, on the consumer home link",
        memory_bytes=24 * GIB,
        peak_flops_per_s=_CPU_MATMUL,
        utilisation=_CPU_ACHIEVED / _CPU_MATMUL,
        sources={
            "memory_bytes": "24 GiB: the reference machine of BENCHMARKS.md",
            "peak_flops_per_s": f"266.38 GFLOP/s: the fp32 matmul rate on the small preset's "
            f"BlockTrain step shapes (matmul_rate_gflops, row small/blocktrain of {_THROUGHPUT})",
            "utilisation": f"0.662: that row's achieved 176.39 GFLOP/s (achieved_gflops) over "
            f"its matmul rate ({_THROUGHPUT})",
            **_HOME_LINK,
        },
        link_down_bytes_per_s=107.50 * MBIT,
        link_up_bytes_per_s=44.10 * MBIT,
        latency_s=0.05,
    ),
}
"""The named profiles (`--profile NAME`)."""


def device_profile(name: str) -> DeviceProfile:
    """A named profile, or a ConfigError listing them."""
    if name not in PROFILES:
        raise ConfigError(f"unknown profile {name!r}; profiles: {', '.join(PROFILES)}")
    return PROFILES[name]
