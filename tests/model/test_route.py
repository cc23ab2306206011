"""`route = features`: block b+1 continues block b's clean stream, with no gradient across."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil

import pytest
import torch

from blocktrain.cli.aggregator_state import AggregatorSetup, prepare_state
from blocktrain.cli.main import build_parser, main
from blocktrain.config import ModelConfig
from blocktrain.data import load_split
from blocktrain.errors import ProtocolError
from blocktrain.model import BlockStack, Sampling, ZLayout, generate_autoregressive, head_logits
from blocktrain.model.cached import KVCache
from blocktrain.model.heads import HeadStage, resolve_exit
from blocktrain.simulate import REGIMES, SimSpec, simulate
from blocktrain.training import load_model
from blocktrain.training.checkpoint import MODEL_FILE, UPSTREAM_FILE, load_tensors
from blocktrain.training.costs import TRAINED_BYTES_PER_PARAM, UPSTREAM_BYTES_PER_PARAM
from blocktrain.training.local import LocalBlockTrainer, initial_blocks
from blocktrain.training.loss import BlockLoss
from blocktrain.training.plan import plan
from blocktrain.training.probe import BlockProbe
from tests.cli.test_cli import TINY, fails_cleanly
from tests.conftest import micro_config

FEATURES = [*TINY[:-1], "route=features", TINY[-1]]  # TINY's --set, the route explicit
STATE = [*TINY[:-1], "route=state", TINY[-1]]  # the other route
CFG = ModelConfig(d_model=32, n_heads=2, layers=3, blocks=3, seq_len=16, span=1, route="features")


def randomised_stack(cfg: ModelConfig = CFG) -> BlockStack:
    """A stack whose zero-initialised parts are made non-zero, so every path carries signal."""
    stack = BlockStack(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in stack.blocks.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return stack.eval()


def inputs(cfg: ModelConfig = CFG) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ZLayout]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (2, cfg.seq_len), generator=gen)
    z = torch.randn(2, cfg.seq_len, cfg.d_model, generator=gen)
    return x, z, torch.full((2,), 1.5), ZLayout.training(cfg.seq_len, cfg.span)


def test_a_block_reads_the_chain_of_clean_streams_before_it():
    stack = randomised_stack()
    x, z, sigma, layout = inputs()
    chain = stack.block(1).clean_stream(x, stack.block(0).clean_stream(x))
    expected = stack.block(2)(x, z, sigma, layout, upstream=chain)[0]
    torch.testing.assert_close(stack.denoise(2, x, z, sigma, layout)[0], expected)
    assert stack.upstream(0, x) is None
    # Under route = state the same weights read nothing from upstream.
    state = BlockStack(dataclasses.replace(CFG, route="state"), seed=0)
    state.load_state_dict(stack.state_dict())
    assert state.upstream(2, x) is None
    alone = stack.block(2)(x, z, sigma, layout)[0]
    torch.testing.assert_close(state.denoise(2, x, z, sigma, layout)[0], alone)
    assert (alone - expected).abs().max() > 1e-3


def test_the_kept_chain_follows_a_new_context_and_new_weights():
    stack = randomised_stack()
    x, z, sigma, layout = inputs()
    first = stack.denoise(2, x, z, sigma, layout)[0]
    x2 = x.clone()
    x2[:, 0] = (x2[:, 0] + 1) % 256
    assert (stack.denoise(2, x2, z, sigma, layout)[0] - first).abs().max() > 0
    with torch.no_grad():
        stack.block(0).layers[0].fc1.weight.mul_(2.0)  # in place: the same tensors
    chain = stack.block(1).clean_stream(x, stack.block(0).clean_stream(x))
    expected = stack.block(2)(x, z, sigma, layout, upstream=chain)[0]
    torch.testing.assert_close(stack.denoise(2, x, z, sigma, layout)[0], expected)


def test_no_gradient_crosses_a_block_boundary():
    stack = randomised_stack().train()
    loss = BlockLoss(CFG, stack.targets, stack.upstream)
    x = inputs()[0]
    parts = loss(stack.block(2), 2, x, torch.Generator().manual_seed(0))
    parts.total.backward()
    assert all(p.grad is None for b in (0, 1) for p in stack.block(b).parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in stack.block(2).parameters())


def test_a_context_byte_reaches_only_later_positions_through_the_chain():
    stack = randomised_stack()
    x, z, sigma, layout = inputs()
    x2 = x.clone()
    x2[:, 5] = (x2[:, 5] + 3) % 256
    moved = stack.denoise(2, x, z, sigma, layout)[0] - stack.denoise(2, x2, z, sigma, layout)[0]
    moved = moved.abs().amax(dim=(0, 2))  # (T,)
    assert (moved[:6] == 0).all(), moved  # position i sees bytes < i (K = 1)
    assert moved[6:].min() > 0


def test_a_stack_without_the_upstream_blocks_says_so():
    stack = BlockStack(CFG, seed=0, blocks=[2])
    x, z, sigma, layout = inputs()
    with pytest.raises(ValueError, match=r"does not hold block\(s\) \[0, 1\]"):
        stack.denoise(2, x, z, sigma, layout)


def test_plan_counts_the_frozen_upstream_in_a_worker_memory():
    cfg = dataclasses.replace(micro_config(), model=CFG)
    state = dataclasses.replace(cfg, model=dataclasses.replace(CFG, route="state"))
    own = plan(state)["worker_state_bytes_per_block"]
    up = plan(cfg)["worker_state_bytes_per_block"]
    table = 256 * CFG.d_model * 4  # the frozen target table, fp32, which every worker holds
    assert own == [plan(state)["params_per_block"][0] * TRAINED_BYTES_PER_PARAM + table] * 3
    step = up[1] - up[0]
    assert up[0] == own[0] and up == [own[0], own[0] + step, own[0] + 2 * step]
    assert 0 < step < own[0] * UPSTREAM_BYTES_PER_PARAM / TRAINED_BYTES_PER_PARAM


def test_a_worker_trains_on_the_upstream_versions_it_was_given(corpus):
    cfg = dataclasses.replace(micro_config(), model=CFG)
    train = load_split(corpus, "train")
    initial = initial_blocks(cfg)
    deltas = []
    for scale in (1.0, 3.0):
        worker = LocalBlockTrainer(cfg, 2, train, data_seed=0)
        assert worker.upstream_blocks == [0, 1]
        worker.load(initial[2])
        with pytest.raises(ProtocolError, match="load_upstream"):
            worker.train(1, 0)
        with pytest.raises(ProtocolError, match="reads blocks"):
            worker.load_upstream({0: initial[0]})
        worker.load_upstream({b: {k: v * scale for k, v in initial[b].items()} for b in (0, 1)})
        worker.train(2, 0)
        deltas.append(worker.delta())
        assert worker.upstream is not None
        assert all(p.grad is None for p in worker.upstream.parameters())
    # the features come from the versions given: other upstream weights, another update
    assert any(not torch.equal(deltas[0][k], deltas[1][k]) for k in deltas[0])
    assert LocalBlockTrainer(cfg, 0, train, data_seed=0).upstream_blocks == []


def test_the_simulator_pulls_the_upstream_versions_each_round(corpus):
    rounds, workers = 3, 6
    reports = {}
    for route in ("state", "features"):
        cfg = dataclasses.replace(micro_config(steps=2 * rounds), model=CFG)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(CFG, route=route))
        spec = SimSpec(
            cfg,
            workers,
            rounds,
            {"local_steps": 2, "effect_probe": "off"},
            seed=cfg.seed,
            eval_bytes=256,
            final_bytes=512,
        )
        report, _ = simulate(
            spec, [REGIMES["lockstep"]], load_split(corpus, "train"), load_split(corpus, "valid")
        )
        reports[route] = report["regimes"]["lockstep"]
    features = reports["features"]
    assert features["updates"]["accepted"] == workers * rounds
    assert features["final_sampler_ce"] < features["initial_ce"]
    # two workers a block; block b's worker also pulls blocks 0..b-1 whole, in 16 bits
    numel = sum(v.numel() for v in initial_blocks(cfg)[0].values())
    extra = rounds * 2 * (0 + 1 + 2) * numel * 2
    assert features["bytes"]["down"] - reports["state"]["bytes"]["down"] == extra
    # with the effect probe on (the default), judged with the upstream versions it reads
    probed, _ = simulate(
        dataclasses.replace(spec, protocol={"local_steps": 2}),
        [REGIMES["lockstep"]],
        load_split(corpus, "train"),
        load_split(corpus, "valid"),
    )
    assert probed["protocol"]["effect_probe"] == "on"
    result = probed["regimes"]["lockstep"]
    assert result["updates"]["accepted"] >= workers * rounds // 2
    assert result["final_sampler_ce"] < result["initial_ce"]


def test_the_simulator_reads_upstream_blocks_as_deltas_with_a_pull_codec(corpus):
    """With compressed pulls, a features worker's reads of the blocks before its own are
    deltas from the views it holds of them (as the HTTP client's `latest`), after one whole
    read each: the upstream reads no longer move whole versions every round (the fp16 run of
    the test above moves every read whole)."""
    rounds, workers = 3, 3
    cfg = dataclasses.replace(micro_config(steps=2 * rounds), model=CFG)
    protocol = {"local_steps": 2, "effect_probe": "off", "delta_wire": "sparse:0.03:2"}
    spec = SimSpec(
        cfg, workers, rounds, protocol, seed=cfg.seed, eval_every=rounds, eval_bytes=256,
        final_bytes=256,
    )  # fmt: skip
    report, _ = simulate(
        spec, [REGIMES["lockstep"]], load_split(corpus, "train"), load_split(corpus, "valid")
    )
    result = report["regimes"]["lockstep"]
    assert result["updates"]["accepted"] == workers * rounds
    # the first round reads each worker's own block and its upstream whole, 1 + 2 + 3 blocks
    # in 16 bits; every later read is a sparse delta, far below a whole block
    numel = sum(v.numel() for v in initial_blocks(cfg)[0].values())
    first_reads = (1 + 2 + 3) * numel * 2
    assert first_reads < result["bytes"]["down"] < first_reads + (rounds - 1) * first_reads // 4


def test_the_probe_judges_a_block_with_the_upstream_versions_it_reads(corpus):
    cfg = dataclasses.replace(micro_config(), model=CFG)
    probe = BlockProbe(cfg, load_split(corpus, "valid"), windows=4, skip_bytes=64)
    stack = randomised_stack()
    weights = {b: stack.block(b).state_dict() for b in range(3)}
    upstream = {0: weights[0], 1: weights[1]}
    before = probe.loss(2, weights[2], upstream)
    assert probe.loss(2, weights[2], upstream) == before  # deterministic
    scaled = {0: {k: 2 * v for k, v in weights[0].items()}, 1: weights[1]}
    assert probe.loss(2, weights[2], scaled) != before
    assert probe.loss(0, weights[0]) == probe.loss(0, weights[0], {1: weights[1]})
    with pytest.raises(ProtocolError, match=r"reads blocks \[1\]"):
        probe.loss(2, weights[2], {0: weights[0]})


def test_a_per_block_aggregator_of_a_features_run_turns_its_probe_off(corpus, tmp_path, capsys):
    """A features block served without the blocks it reads cannot be probed here: refused with
    the probe on (nothing written), served with it off; block 0, which reads nothing, and an
    aggregator of blocks 0 and 1 keep their probe."""
    state = tmp_path / "state"

    def argv(*flags):
        return [
            "aggregator",
            "--state",
            str(state),
            "--preset",
            "tiny",
            "--data",
            str(corpus),
            "--set",
            "route=features",
            *flags,
        ]

    fails_cleanly(capsys, argv("--blocks", "1,2"), "read block(s) [0], which another aggregator")
    assert not state.exists()
    for flags in (
        ("--blocks", "0"),
        ("--blocks", "0,1"),
        ("--blocks", "2", "--effect-probe", "off"),
    ):
        opened, _, directory = prepare_state(
            AggregatorSetup.of(build_parser().parse_args(argv(*flags)))
        )
        assert list(directory.served) == [int(b) for b in flags[1].split(",")]
        opened.close()
        shutil.rmtree(state)
    # a restart may not turn the probe back on
    args = build_parser().parse_args(argv("--blocks", "1", "--effect-probe", "off"))
    prepare_state(AggregatorSetup.of(args))[0].close()
    restart = ["aggregator", "--state", str(state), "--effect-probe", "on"]
    fails_cleanly(capsys, restart, "pass --effect-probe off")


def test_a_later_block_trains_alone_on_an_upstream_run(corpus, tmp_path, capsys):
    """`train --block 1` under features reads block 0 frozen from `--upstream RUN_DIR`: refused
    without one (nothing written), trained with one (block 0 copied, never trained), resumed
    from the copy, and its losses depend on the upstream weights it was given."""

    def argv(out, *more):
        return [
            "train",
            "--data",
            str(corpus),
            "--steps",
            "4",
            "--json",
            "--out",
            str(tmp_path / out),
            *more,
        ]

    def one(out, upstream=None, route=FEATURES):
        more = [] if upstream is None else ["--upstream", str(tmp_path / upstream)]
        return argv(out, "--block", "1", *more, *route)

    fails_cleanly(capsys, one("x"), "give --upstream RUN_DIR")
    assert not (tmp_path / "x").exists()
    assert main(argv("f0", "--block", "0", *FEATURES)) == 0
    short = argv("short", "--block", "0", *FEATURES)
    short[short.index("--steps") + 1] = "2"
    assert main(short) == 0  # another block 0: trained for fewer steps
    capsys.readouterr()
    assert main(one("f1", "f0")) == 0
    f1 = json.loads(capsys.readouterr().out)
    assert set(f1["last_eval"]) == {"block1"}, "the oracle CE of the trained block only"
    source, _ = load_tensors(tmp_path / "f0" / MODEL_FILE)
    copied, _ = load_tensors(tmp_path / "f1" / UPSTREAM_FILE)
    trained, _ = load_tensors(tmp_path / "f1" / MODEL_FILE)
    assert set(copied) == {k for k in source if k.startswith("block.0.")}
    assert all(torch.equal(copied[k], source[k]) for k in copied)
    assert not any(k.startswith("block.0.") for k in trained), "block 0 is read, not trained"
    # another block 0 upstream gives other losses: the block reads it
    assert main(one("g1", "short")) == 0
    g1 = json.loads(capsys.readouterr().out)
    assert g1["last_train"]["loss"] != f1["last_train"]["loss"]
    # a resume reads the copy in the run folder, and needs it
    resume = [
        "train",
        "--data",
        str(corpus),
        "--resume",
        "--out",
        str(tmp_path / "f1"),
        "--steps",
        "6",
        "-q",
    ]
    assert main(resume) == 0
    (tmp_path / "f1" / UPSTREAM_FILE).unlink()
    fails_cleanly(capsys, resume, "give --upstream RUN_DIR")
    # refusals, each before anything is written
    for upstream, message in (
        ("g1", "no --upstream run holds block(s) [0]"),
        ("nowhere", "does not exist"),
    ):
        fails_cleanly(capsys, one("y", upstream), message)
    fails_cleanly(capsys, one("y", "f0", route=STATE), "read none")
    assert main(argv("s0", "--block", "0", *[*FEATURES[:-1], "seed=3", FEATURES[-1]])) == 0
    fails_cleanly(capsys, one("y", "s0"), "of another model config or seed")
    assert not (tmp_path / "y").exists()


def test_train_eval_generate_a_features_run(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--data", str(corpus), "--out", str(run), "--steps", "2", *FEATURES]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--data", str(corpus), "--json", "--bytes", "64", "-q"]) == 0
    out = capsys.readouterr().out
    assert '"oracle_ce"' in out and '"sampler_ce"' in out
    texts = {}
    for exit_ in ("auto", "sampler", "head"):
        argv = ["generate", str(run), "--prompt", "The ", "--bytes", "8", "--exit", exit_]
        assert main(argv) == 0
        texts[exit_] = capsys.readouterr().out
    assert main(["generate", str(run), "--prompt", "The ", "--bytes", "8"]) == 0
    assert capsys.readouterr().out == texts["auto"], "auto is the default"
    assert texts["auto"].startswith("The ")
    assert texts["auto"] == texts["sampler"] != texts["head"], "a forward stack: the sampler"


def test_the_auto_exit_is_the_head_of_a_reversed_features_stack_only():
    reversed_ = dataclasses.replace(CFG, intervals="reversed")
    assert resolve_exit("auto", CFG) == "sampler"
    assert resolve_exit("auto", reversed_) == "head"
    assert resolve_exit("auto", dataclasses.replace(reversed_, route="state")) == "sampler"
    assert resolve_exit("auto", dataclasses.replace(reversed_, aux_weight=0.0)) == "sampler"
    assert resolve_exit("auto", None) == "sampler", "a reference"
    assert [resolve_exit(e, reversed_) for e in ("sampler", "head")] == ["sampler", "head"]
    with pytest.raises(ValueError, match="not one of auto, sampler, head"):
        resolve_exit("tail", CFG)


def test_the_head_exit_reads_the_chain_and_sees_no_later_byte():
    """The last block's head over the chain of clean streams (`head_logits`): what its clean
    stream and head compute by hand, causal (a later byte changes no earlier logits), and
    deeper than block 0's own head."""
    stack = randomised_stack()
    x, *_ = inputs()
    chain = stack.block(1).clean_stream(x, stack.block(0).clean_stream(x))
    last = stack.block(2)
    by_hand = last.aux_head(last.aux_norm(last.clean_stream(x, chain)))
    torch.testing.assert_close(head_logits(stack, x), by_hand)
    changed = x.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    before, after = head_logits(stack, x), head_logits(stack, changed)
    torch.testing.assert_close(before[:, :9], after[:, :9])
    assert (before[:, 9:] - after[:, 9:]).abs().max() > 1e-4
    assert (head_logits(stack, x, 0) - before).abs().max() > 1e-3


def test_eval_and_generate_take_the_head_exit(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(run), "--steps", "2", *FEATURES]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--data", str(corpus), "--json", "--bytes", "64", "-q"]) == 0
    heads = json.loads(capsys.readouterr().out)["head_ce_per_block"]
    assert len(heads) == 3 and all(2.0 < h < 8.0 for h in heads)
    argv = ["generate", str(run), "--prompt", "The ", "--bytes", "12", "--exit", "head"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert main(argv) == 0 and capsys.readouterr().out == text, "seeded"
    _, stack = load_model(run)
    expected = generate_autoregressive(
        functools.partial(head_logits, stack),
        torch.tensor([list(b"The ")]),
        12,
        seq_len=stack.cfg.seq_len,
        sampling=Sampling(),
        generator=torch.Generator().manual_seed(0),
    )
    assert text == (b"The " + bytes(expected[0].tolist())).decode(errors="replace") + "\n"
    ref = tmp_path / "ref"
    train_ref = ["train", "--data", str(corpus), "--out", str(ref), "--steps", "1", "--reference"]
    assert main([*train_ref, *TINY]) == 0
    fails_cleanly(capsys, ["generate", str(ref), "--prompt", "a", "--exit", "head"], "a reference")


def test_a_reversed_features_stack_trains_evaluates_and_generates(corpus, tmp_path, capsys):
    """intervals = reversed: `train`, `eval` (with its head exit) and `generate` run it in one
    process (a chain of hosts serves it through the head exit only: tests/serving)."""
    run = tmp_path / "run"
    reversed_ = [*FEATURES[:-1], "intervals=reversed", FEATURES[-1]]
    assert (
        main(["train", "--data", str(corpus), "--out", str(run), "--steps", "2", *reversed_]) == 0
    )
    capsys.readouterr()
    assert main(["eval", str(run), "--data", str(corpus), "--json", "--bytes", "64", "-q"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert len(ev["sampler_ce_per_step"]) == len(ev["head_ce_per_block"]) == 3
    texts = {}
    for exit_ in ("sampler", "head", "auto"):
        assert (
            main(["generate", str(run), "--prompt", "The ", "--bytes", "6", "--exit", exit_]) == 0
        )
        texts[exit_] = capsys.readouterr().out
        assert texts[exit_].startswith("The ")
    assert texts["auto"] == texts["head"] != texts["sampler"], "auto reads a reversed stack's head"


def test_head_stages_with_caches_chain_to_the_head_exit():
    """The head exit's pipeline (one HeadStage per block, each with its cache): a prefill and
    then one byte at a time give `head_logits` of the whole context at every position."""
    stack = randomised_stack()
    x, *_ = inputs()
    stages = [HeadStage(stack.block(b), last=b == 2) for b in range(3)]
    caches = [KVCache() for _ in stages]
    expected = head_logits(stack, x)
    pieces = []
    for lo, hi in ((0, 5), *((i, i + 1) for i in range(5, x.shape[1]))):
        h = None
        for stage, cache in zip(stages, caches, strict=True):
            h = stage(x[:, lo:hi], h, cache)
        pieces.append(h)
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, rtol=1e-4, atol=1e-5)
    assert caches[2].length == x.shape[1]
