"""Distilling a drafter (docs/model.md, "Speculative generation"): fine-tune a small autoregressive
byte model (a `--reference` run) towards the law of the model whose drafts it makes, not the data.

For a K = 1 BlockTrain teacher that law q is the one-sweep sampler's, which no single pass
computes; but one sweep's distribution p is an unbiased estimate of it (E p = q), and the
cross-entropy -sum_y p(y) log r(y) is linear in p, so one sweep per batch, with fresh noise,
gives an unbiased gradient of the cross-entropy to q itself (DistillSpec, arXiv 2310.08461). An
autoregressive teacher's law is its softmax. The teacher is named in the run folder
(`distill.json`), so a distillation resumes like any run."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from blocktrain.errors import CheckpointError, ConfigError
from blocktrain.fsutil import atomic_write_bytes
from blocktrain.model import BlockStack, Reference, SigmaSchedule, ZLayout, stack_denoiser
from blocktrain.model.sampler import one_sweep, sampler_for
from blocktrain.training.checkpoint import load_model
from blocktrain.training.loss import LossParts

DISTILL_FILE = "distill.json"


@dataclass(frozen=True)
class TeacherSpec:
    """What a distillation run learns from: a trained run, and for a BlockTrain run the sampler
    whose law the drafts will be verified against."""

    run: str
    """The teacher's run folder, as an absolute path."""
    sampler: str = "euler"
    steps_per_block: int = 1

    def write(self, run_dir: Path) -> None:
        atomic_write_bytes(run_dir / DISTILL_FILE, (json.dumps(asdict(self)) + "\n").encode())

    @staticmethod
    def read(run_dir: Path) -> TeacherSpec | None:
        """The run's teacher, or None for a run trained on the data."""
        path = Path(run_dir) / DISTILL_FILE
        if not path.exists():
            return None
        try:
            return TeacherSpec(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as exc:
            raise CheckpointError(f"{path} is corrupt ({exc})") from exc


class Teacher:
    """The law a student is distilled towards, position by position of a batch."""

    def __init__(self, spec: TeacherSpec, seq_len: int, device: torch.device) -> None:
        self.spec = spec
        _, model = load_model(Path(spec.run), device)
        if model.cfg.seq_len < seq_len:
            raise ConfigError(
                f"the teacher {spec.run} sees {model.cfg.seq_len} bytes, fewer than the "
                f"student's T = {seq_len}"
            )
        self.model = model
        if isinstance(model, BlockStack):
            if not model.has_all_blocks() or model.cfg.span != 1:
                raise ConfigError(
                    f"the teacher {spec.run} must be a whole K = 1 BlockTrain model (it has "
                    f"span {model.cfg.span} and blocks {model.block_ids}): drafts are verified "
                    "one byte per position"
                )
            self.method = sampler_for(spec.sampler)
            self.grid = SigmaSchedule.from_config(model.cfg).sampler_grid(spec.steps_per_block)
            self.denoise = stack_denoiser(model)
            self.layout = ZLayout.training(seq_len, 1, device)

    @torch.no_grad()
    def probs(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """x (N, T) -> the teacher's law of bytes 1..T-1, each given the bytes before it
        (N, T - 1, 256) fp32: one sweep with fresh noise for a BlockTrain teacher (an unbiased
        estimate of its sampler's law), the softmax for an autoregressive one."""
        if isinstance(self.model, Reference):
            return torch.softmax(self.model(x)[:, :-1].float(), dim=-1)
        assert isinstance(self.model, BlockStack)
        n, length = x.shape
        d = self.model.cfg.d_model
        noise = torch.randn(n, length, d, generator=generator, device=generator.device)
        z = self.grid[0][1] * noise.to(x.device)
        logits = one_sweep(
            self.denoise,
            x,
            z,
            self.grid,
            self.model.targets,
            self.layout,
            method=self.method,
            generator=generator,
        )
        return torch.softmax(logits[:, 1:].float(), dim=-1)


def distill_loss(
    student: Reference, teacher: Teacher, x: torch.Tensor, generator: torch.Generator
) -> LossParts:
    """The cross-entropy of the student's next-byte law to the teacher's, over the batch; its
    CE on the data itself is logged beside it."""
    target = teacher.probs(x, generator)
    logits = student(x)[:, :-1].float()
    log_r = torch.log_softmax(logits, dim=-1)
    ce = -(target * log_r).sum(-1).mean()
    data_ce = -log_r.gather(-1, x[:, 1:, None]).mean()
    return LossParts(ce, {"loss": float(ce.detach()), "data_ce": float(data_ce.detach())})
