"""`blocktrain distill`: fine-tune a drafter (a small `--reference` run) towards the law of the
model that verifies its drafts, so that more of each draft is accepted.

The student starts from its run's weights and keeps its model config; every update draws a batch
of training text and scores the student's next-byte law against the teacher's (one sweep with
fresh noise for a K = 1 BlockTrain teacher, an unbiased estimate of its sampler's law; the
softmax for an autoregressive one). The result is a `--reference` run: serve it with
`blocktrain serve --draft-model DIR`. The teacher is recorded in the run, so `--resume` continues.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from blocktrain.cli.common import (
    Formatter,
    add_data_arg,
    add_device_arg,
    add_log_arg,
    add_progress_arg,
    file_patterns,
    log_backends,
)
from blocktrain.cli.evaluate import check_model_sampler
from blocktrain.cli.train import run_and_report, splits
from blocktrain.data.provenance import check_data, corpus_record, write_record
from blocktrain.device import resolve_device
from blocktrain.errors import ConfigError
from blocktrain.training import Trainer, read_config
from blocktrain.training.distill import TeacherSpec

EXAMPLES = """examples:
  blocktrain train --preset tiny --reference --set layers=1 blocks=1 seq_len=128 \\
      --steps 8000 --out runs/drafter                        # a drafter, trained on text
  blocktrain distill --teacher runs/small --student runs/drafter --out runs/drafter-kd
  blocktrain distill --teacher runs/small --student runs/drafter --sampler ancestral \\
      --steps 800 --lr 5e-4 --out runs/drafter-kd-anc
  blocktrain distill --resume --out runs/drafter-kd --steps 800   # continue, to 800 updates
  blocktrain serve --hosts ... --port 8100 --draft-model runs/drafter-kd  # draft with it
"""

DEFAULT_STEPS = 400
DEFAULT_LR = 1e-3


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "distill",
        help="distil a drafter towards the model that verifies its drafts",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument(
        "--teacher",
        metavar="RUN",
        help="the verifier: a K = 1 BlockTrain run (or a --reference one)",
    )
    p.add_argument("--student", metavar="RUN", help="the drafter to start from (a --reference run)")
    p.add_argument("--out", metavar="DIR", required=True, help="the distilled drafter's run")
    p.add_argument(
        "--steps", type=int, help=f"updates (default {DEFAULT_STEPS}; with --resume, a new total)"
    )
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {DEFAULT_LR})")
    p.add_argument(
        "--sampler",
        help="the teacher's sampler, as the drafted requests will run it (default: euler)",
    )
    p.add_argument(
        "--steps-per-block", type=int, default=1, help="the teacher's sampler points per block"
    )
    add_data_arg(p)
    add_device_arg(p, default=None)
    p.add_argument("--resume", action="store_true", help="continue the distillation in --out")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    add_log_arg(p)
    add_progress_arg(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    log_backends(args)  # an unknown backend or a missing library: before anything is written
    if args.steps is not None and args.steps <= 0:
        raise ConfigError(f"--steps {args.steps} must be positive")
    if args.lr is not None and not args.lr > 0:
        raise ConfigError(f"--lr {args.lr} must be positive")
    if args.device is not None:
        resolve_device(args.device)  # before anything is read or written
    out = Path(args.out)
    if args.resume:
        if args.teacher or args.student or args.lr is not None or args.sampler:
            raise ConfigError(
                "--resume continues a distillation with its saved teacher and settings; only "
                "--steps, --data and --glob may be given"
            )
        if TeacherSpec.read(out) is None:
            raise ConfigError(f"{out} is not a distillation run (no teacher recorded)")
        train, valid = splits(args.data, file_patterns(args))
        check_data(out, args.data, ("train",), file_patterns(args))  # a warning when it differs
        trainer = Trainer.resume(out, train, valid, steps=args.steps, device=args.device)
    else:
        if not args.teacher or not args.student:
            raise ConfigError("distill needs --teacher RUN and --student RUN (or --resume)")
        if args.steps_per_block < 1:
            raise ConfigError(f"--steps-per-block {args.steps_per_block} must be >= 1")
        student = read_config(Path(args.student))
        if student.kind != "reference":
            raise ConfigError(
                f"--student {args.student} is a {student.kind} run; a drafter is an "
                "autoregressive run (blocktrain train --reference)"
            )
        teacher = read_config(Path(args.teacher))
        sampler = check_model_sampler(args.sampler, teacher) or "euler"
        steps = args.steps or DEFAULT_STEPS
        cfg = student.config
        tcfg = dataclasses.replace(
            cfg.train,
            steps=steps,
            lr=args.lr or DEFAULT_LR,
            warmup_steps=min(cfg.train.warmup_steps, steps // 10),
            eval_every=max(1, steps // 4),
            checkpoint_every=max(1, steps // 4),
            device=args.device or cfg.train.device,
        )
        resolve_device(tcfg.device)  # the student's own device, when --device is not given
        spec = TeacherSpec(str(Path(args.teacher).resolve()), sampler, args.steps_per_block)
        train, valid = splits(args.data, file_patterns(args))
        record = corpus_record(args.data, patterns=file_patterns(args))
        trainer = Trainer.create(
            dataclasses.replace(cfg, train=tcfg),
            out,
            train,
            valid,
            kind="reference",
            overwrite=args.overwrite,
            teacher=spec,
            init_from=Path(args.student),
        )
        write_record(out, record)  # data.json, as train writes it
    return run_and_report(trainer, args, "distilled")
