"""Probe (issue 11): block-local *masked* span diffusion, span-research.md's R1, before building it
into the product. Does revealing a span's bytes in rounds, each block owning an interval of
mask rates, write readable text where the Gaussian span models do not?

What it trains, for each span K (tiny shape, the preset's steps per block, seed 0):
- the product's `Block`, fed a masked span instead of a noisy one: the state is z_i = E[y_i] for
  a revealed byte and 0 for a masked one, the mask rate t passes through the noise embedding as
  sigma = 10^t (the block only needs a monotone code of t), and the z tokens are the block's own
  byte embedding or a learned [MASK] (`--tokens embed`, R1) or the projected state as in the
  Gaussian blocks (`--tokens table`);
- block b owns mask rates t in [(B-1-b)/B, (B-b)/B] (block 0 the most masked), widened by the
  preset's overlap; a sequence draws t, masks each byte with probability t, and the block-local
  loss is the CE on the masked bytes (a mean; MD4's 1/t weight left out of this probe), plus the
  product's auxiliary next-byte loss on the clean stream (as `BlockLoss`). A share
  of the sequences (--prefix-share) masks a suffix of each span instead, the states the
  left-to-right sampler visits.

How it samples a span: all masked; block b takes the span from the top of its mask-rate interval
to the bottom (K (B-b)/B masked bytes down to K (B-1-b)/B), in S rounds, each revealing the
leftmost masked bytes (drawn at temperature 1 from that round's logits), so one traversal of the
block hosts still yields the span. When a block's S rounds cover its bytes, each round reveals
one byte: a left-to-right factorisation.

Then the same judge and prompts as bench/span_frontier.py score the continuations. Writes
benchmarks/results/masked_span_probe.json and the `masked-span-probe` section of BENCHMARKS.md.

    python bench/masked_span_probe.py                    # ~15 min on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from blocktrain.config import ModelConfig, TrainConfig, preset
from blocktrain.data import load_split
from blocktrain.model import Block, BlockStack, Reference, ZLayout
from blocktrain.training import load_model
from blocktrain.training.generated import (
    GenSettings,
    evaluate_generation,
    judge_continuations,
    split_prompts,
)
from blocktrain.training.optim import make_optimizer
from report import ROOT, machine, update_section, write_json  # bench/report.py
from span_frontier import trained  # bench/span_frontier.py

WORK = ROOT / "benchmarks" / "work" / "span_frontier"


class MaskedBlock(Block):
    """The product's block with R1's span tokens: a revealed byte enters the z stream as the
    block's own (private) byte embedding, a masked one as a learned [MASK] vector, instead of the
    projected state. The state still travels as z = E[y] or 0, which determines y exactly."""

    def __init__(self, cfg: ModelConfig, targets: torch.Tensor) -> None:
        super().__init__(cfg)
        self.mask_token = nn.Parameter(torch.zeros(cfg.d_model))
        self.register_buffer("table", targets.clone(), persistent=False)

    def z_tokens(
        self, x_bytes: torch.Tensor, z: torch.Tensor, c_in: torch.Tensor, layout: ZLayout
    ) -> torch.Tensor:
        base = super().z_tokens(x_bytes, torch.zeros_like(z), c_in, layout)  # + the prev byte
        revealed = z.norm(dim=-1, keepdim=True) > 0.5  # (N, Lz, 1)
        y = (z @ self.table.T).argmax(dim=-1)  # (N, Lz): exact for revealed positions
        return base + torch.where(revealed, self.embed(y), self.mask_token)


def build_stack(cfg: ModelConfig, seed: int, tokens: str) -> BlockStack:
    stack = BlockStack(cfg, seed)
    if tokens == "embed":
        for b in stack.block_ids:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed * 1_000_003 + 7919 * (b + 1))
                stack.blocks[str(b)] = MaskedBlock(cfg, stack.targets)
    return stack


def mask_interval(block: int, blocks: int, overlap: float) -> tuple[float, float]:
    lo, hi = (blocks - 1 - block) / blocks, (blocks - block) / blocks
    width = hi - lo
    return max(0.0, lo - overlap * width), min(1.0, hi + overlap * width)


def masked_state(targets: torch.Tensor, y: torch.Tensor, revealed: torch.Tensor) -> torch.Tensor:
    """z (N, L, d): E[y] where revealed, 0 where masked."""
    return targets[y] * revealed[..., None].to(targets.dtype)


def train_block(
    stack: BlockStack, b: int, train: Any, tcfg: TrainConfig, seed: int, prefix_share: float
) -> list[float]:
    cfg = stack.cfg
    block = stack.block(b)
    block.train()
    opt = make_optimizer(block, tcfg)
    steps, batch, lr = tcfg.steps, tcfg.batch_size, tcfg.lr
    gen = torch.Generator().manual_seed(seed * 1000 + b)
    layout = ZLayout.training(cfg.seq_len, cfg.span)
    lo, hi = mask_interval(b, cfg.blocks, cfg.overlap)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:  # warmup then cosine, as the preset's schedule
            warm = min(1.0, (step + 1) / max(1, steps // 10))
            group["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
        x = train.sample(batch, cfg.seq_len, gen)  # (N, T)
        t = lo + (hi - lo) * torch.rand(batch, generator=gen)  # (N,)
        masked = torch.rand(x.shape, generator=gen) < t[:, None]
        # Half the sequences mask a suffix of every span instead (the first (1 - t) K bytes
        # revealed): the states the left-to-right sampler visits (CDCD's mixed masks).
        in_span = (torch.arange(cfg.seq_len) % cfg.span)[None, :]  # (1, T)
        suffix = in_span >= torch.round((1 - t) * cfg.span)[:, None]
        prefix_rows = torch.rand(batch, generator=gen) < prefix_share
        masked = torch.where(prefix_rows[:, None], suffix, masked)
        masked[:, 0] |= ~masked.any(dim=1)  # at least one byte to learn from
        z = masked_state(stack.targets, x, ~masked)
        logits, aux = block(x, z, 10.0**t, layout, with_aux=cfg.aux_weight > 0)  # (N, T, 256)
        loss = F.cross_entropy(logits[masked], x[masked])
        if aux is not None:  # the product's block-local auxiliary next-byte loss, as BlockLoss
            loss = loss + cfg.aux_weight * F.cross_entropy(
                aux[:, :-1].flatten(0, 1), x[:, 1:].flatten()
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(block.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    block.eval()
    return losses


@torch.no_grad()
def continue_masked(
    stack: BlockStack, prompts: torch.Tensor, n: int, rounds_per_block: int, seed: int
) -> torch.Tensor:
    cfg = stack.cfg
    gen = torch.Generator().manual_seed(seed)
    context = prompts
    out = []
    for _ in range(math.ceil(n / cfg.span)):
        x = context[:, -(cfg.seq_len - cfg.span) :]
        layout = ZLayout.next_span(x.shape[1], cfg.span)
        y = torch.zeros(x.shape[0], cfg.span, dtype=torch.long)
        revealed = torch.zeros(x.shape[0], cfg.span, dtype=torch.bool)
        for b in range(cfg.blocks):
            # Block b takes the span from its interval's top mask rate to its bottom one.
            target = round(cfg.span * (cfg.blocks - 1 - b) / cfg.blocks)
            for s in range(rounds_per_block):
                left = cfg.span - int(revealed[0].sum())
                take = math.ceil((left - target) / (rounds_per_block - s))
                if take <= 0:
                    continue
                t = torch.full((x.shape[0],), left / cfg.span)
                logits = stack.block(b)(
                    x, masked_state(stack.targets, y, revealed), 10.0**t, layout
                )[0]
                start = cfg.span - left  # left to right: the masked bytes are a suffix
                probs = logits[:, start : start + take].float().softmax(-1)
                draw = torch.multinomial(probs.reshape(-1, 256), 1, generator=gen)
                y[:, start : start + take] = draw.reshape(x.shape[0], take)
                revealed[:, start : start + take] = True
        out.append(y)
        context = torch.cat((context, y), dim=1)
    return torch.cat(out, dim=1)[:, :n]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--spans", default="4,16")
    p.add_argument("--rounds", default="1,2,6", help="S, reveal rounds per block")
    p.add_argument("--steps", type=int, default=0, help="per block (0: the preset's)")
    p.add_argument("--judge-steps", type=int, default=400)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--name",
        default="masked_span_probe",
        help="the JSON file (NAME.json) and BENCHMARKS.md section this run writes",
    )
    p.add_argument(
        "--tokens",
        default="embed",
        choices=("embed", "table"),
        help="z tokens: the block's byte embedding / [MASK] (R1), or the projected E[y] / 0",
    )
    p.add_argument(
        "--prefix-share", type=float, default=0.5, help="sequences trained on suffix masks"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    base = preset("tiny")
    steps = args.steps or base.train.steps
    _, judge = load_model(WORK / f"judge-{args.judge_steps}")
    assert isinstance(judge, Reference)
    test = load_split(None, "test")
    train = load_split(None, "train")
    prompts, real = split_prompts(test.windows(256, 256 * args.prompts), 128)
    rows = []
    for k in [int(v) for v in args.spans.split(",")]:
        cfg = dataclasses.replace(base.model, span=k)
        stack = build_stack(cfg, base.seed, args.tokens)
        t0 = time.perf_counter()
        final = []
        for b in range(cfg.blocks):
            tcfg = dataclasses.replace(base.train, steps=steps)
            losses = train_block(stack, b, train, tcfg, base.seed, args.prefix_share)
            final.append(sum(losses[-20:]) / len(losses[-20:]))  # masked CE + aux CE
        print(f"K={k}: trained in {time.perf_counter() - t0:.0f} s; loss {final}", file=sys.stderr)
        for s in [int(v) for v in args.rounds.split(",")]:
            generated = continue_masked(stack, prompts, real.shape[1], s, seed=0)
            judged = judge_continuations(judge, prompts, generated, real)
            row = {
                "method": "masked-left-to-right",
                "span": k,
                "rounds_per_block": s,
                "rounds": cfg.blocks * s,
                "prefix_share": args.prefix_share,
                "tokens": args.tokens,
                "train_loss_per_block": final,
                "gen_ce": judged["gen_ce"],
                "gen_ce_sem": judged["gen_ce_sem"],
                "floor_ce": judged["floor_ce"],
                "entropy": judged["entropy"],
                "real_entropy": judged["real_entropy"],
                "sample": bytes(generated[0].tolist()).decode("utf-8", "replace"),
            }
            print(
                f"  S={s}: gen_ce {row['gen_ce']:.3f} entropy {row['entropy']:.3f}", file=sys.stderr
            )
            rows.append(row)
    # The plain AR reference trained for as many steps, judged the same way: the fair yardstick
    # (the span frontier's AR row has the preset's steps).
    ref_dir = trained(
        WORK / "tiny" / f"ref-{steps}", ["--preset", "tiny", "--reference", "--steps", str(steps)]
    )
    _, ref = load_model(ref_dir)
    assert isinstance(ref, Reference)
    windows = torch.cat((prompts, real), dim=1)
    ar = evaluate_generation(ref, judge, windows, GenSettings(prompts=args.prompts))
    print(f"AR reference, {steps} steps: gen_ce {ar['gen_ce']:.3f}", file=sys.stderr)
    doc = {
        "ar_reference": {
            "steps": steps,
            "gen_ce": ar["gen_ce"],
            "gen_ce_sem": ar["gen_ce_sem"],
            "entropy": ar["entropy"],
        },
        "preset": "tiny",
        "steps_per_block": steps,
        "judge_steps": args.judge_steps,
        "prompts": args.prompts,
        "command_args": "".join(f" {a}" for a in sys.argv[1:]),
        "machine": machine(),
        "rows": rows,
    }
    write_json(f"{args.name}.json", doc)
    report(doc, args.name)


def report(doc: dict[str, Any], name: str) -> None:
    lines = [
        "## Masked span probe (issue 11, span-research.md R1)",
        "",
        f"`python bench/masked_span_probe.py{doc.get('command_args', '')}`; JSON: "
        f"`benchmarks/results/{name}.json`. "
        f"Tiny shape, {doc['steps_per_block']} steps per block; the same judge "
        f"({doc['judge_steps']} steps) and {doc['prompts']} test prompts as the span frontier, "
        "whose table holds the AR pipeline's and the Gaussian span models' gen_ce. Not a product "
        "feature yet: a probe of whether the recipe is worth building.",
        "",
        "| K | rounds per block S | rounds | gen_ce (± s.e.) | entropy (real) | final train loss per block |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for r in doc["rows"]:
        loss = ", ".join(f"{v:.2f}" for v in r["train_loss_per_block"])
        lines.append(
            f"| {r['span']} | {r['rounds_per_block']} | {r['rounds']} | "
            f"{r['gen_ce']:.3f} ± {r['gen_ce_sem']:.3f} | {r['entropy']:.3f} "
            f"({r['real_entropy']:.3f}) | {loss} |"
        )
    ar = doc.get("ar_reference")
    if ar is not None:
        lines += [
            "",
            f"The AR reference trained for the same {ar['steps']} steps, same judge and prompts: "
            f"gen_ce {ar['gen_ce']:.3f} ± {ar['gen_ce_sem']:.3f}, entropy {ar['entropy']:.3f}.",
        ]
    update_section(name.replace("_", "-"), "\n".join(lines))


if __name__ == "__main__":
    main()
