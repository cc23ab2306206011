"""The model side of the aggregator's live evaluation (`AggregatorSettings.live_eval_every`;
`protocol.service.live_eval` schedules it and, as the protocol never imports the model, this is
injected as the effect probe is): `blocktrain cluster`'s per-round evaluation
(`local.evaluate_units`) on the first `live_eval_bytes` of the validation split with fixed
noise, so that the curve moves only with the model. The slice ends before `PROBE_SKIP_BYTES`,
where the effect probe's starts, so an update the probe accepted is never judged on the bytes
that score it."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from blocktrain.config import RunConfig
from blocktrain.data import ByteSource
from blocktrain.errors import ConfigError
from blocktrain.training.evaluate import EvalSettings
from blocktrain.training.local import evaluate_units
from blocktrain.training.probe import PROBE_SKIP_BYTES

Tensors = dict[str, torch.Tensor]

THREADS = 1
"""CPU threads of one evaluation: it runs beside the request threads (and, in a cluster, the
workers), and one thread is steady where it has to share the cores, where more threads would
fight the other work for them."""

RECORDED = ("from_noise_ce", "sampler_ce")
"""What a live evaluation keeps of `evaluate_blocktrain`'s metrics (history.EVAL_KEYS), as the
cluster's per-round evaluation does; and `joint_ce` for spans K > 1, where the sampler CE is
only a per-byte marginal (at K = 1 the joint CE is the sampler CE)."""


class AssembledEval:
    """`evaluator(blocks)`: the validation CEs of the model assembled from `blocks` (block ->
    fp32 weights, every block of the run; block 0 alone for a reference unit)."""

    def __init__(
        self,
        cfg: RunConfig,
        unit: str,
        valid: ByteSource,
        n_bytes: int,
        sweeps: int,
        threads: int = THREADS,
    ):
        if n_bytes > PROBE_SKIP_BYTES:
            raise ConfigError(
                f"--set live_eval_bytes={n_bytes} reaches into the effect probe's held-out slice "
                f"(from byte {PROBE_SKIP_BYTES} of the validation split): at most "
                f"{PROBE_SKIP_BYTES}"
            )
        self.cfg = cfg
        self.unit = unit
        self.windows = valid.windows(cfg.model.seq_len, n_bytes)
        self.settings = EvalSettings(sweeps=sweeps, seed=cfg.seed, oracle=False)
        self.threads = threads

    @property
    def bytes(self) -> int:
        """The bytes scored (whole windows: `n_bytes` rounded up to T, or the split's length)."""
        return int(self.windows.numel())

    @property
    def sweeps(self) -> int:
        return self.settings.sweeps

    def __call__(self, blocks: Mapping[int, Tensors]) -> dict[str, float]:
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)  # the calling thread's (OpenMP), then restored
        try:
            with torch.no_grad():
                ev = evaluate_units(self.cfg, self.unit, dict(blocks), self.windows, self.settings)
        finally:
            torch.set_num_threads(before)
        keys = (*RECORDED, "joint_ce") if self.cfg.model.span > 1 else RECORDED
        return {k: float(ev[k]) for k in keys if isinstance(ev.get(k), int | float)}
