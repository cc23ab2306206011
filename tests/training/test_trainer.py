import json

import pytest
import torch

from blocktrain.config import apply_overrides
from blocktrain.data import load_split
from blocktrain.errors import BlockTrainError, CheckpointError
from blocktrain.model import BlockStack, target_table
from blocktrain.training import BlockLoss, Trainer, load_model
from blocktrain.training.checkpoint import iter_metrics
from tests.conftest import micro_config


def splits(corpus):
    return load_split(corpus, "train"), load_split(corpus, "valid")


def losses(run_dir):
    return [m["loss"] for m in iter_metrics(run_dir) if m["event"] == "train"]


def test_training_one_block_touches_nothing_else():
    cfg = micro_config()
    stack = BlockStack(cfg.model, cfg.seed)
    before = {k: v.clone() for k, v in stack.state_dict().items()}
    loss = BlockLoss(cfg.model, stack.targets)
    block = stack.block(1)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randint(0, 256, (4, cfg.model.seq_len), generator=gen)
        opt.zero_grad()
        loss(block, 1, x, gen).total.backward()
        opt.step()
    after = stack.state_dict()
    for name, value in before.items():
        if name.startswith("blocks.1."):
            continue
        assert torch.equal(value, after[name]), f"{name} changed while training block 1"
    assert any(not torch.equal(before[n], after[n]) for n in before if n.startswith("blocks.1."))
    for b in (0, 2):
        assert all(p.grad is None for p in stack.block(b).parameters()), "no gradient leaks"
    assert torch.equal(stack.targets, target_table(cfg.seed, cfg.model.d_model))


def test_one_block_run_matches_the_full_runs_initialisation_elsewhere(tmp_path, corpus):
    cfg = micro_config(steps=2)
    train, valid = splits(corpus)
    # route = features: block 2 reads blocks 0 and 1, frozen, from a run that holds them
    Trainer.create(cfg, tmp_path / "b01", train, valid, blocks=[0, 1]).run(progress=False)
    trainer = Trainer.create(
        cfg, tmp_path / "b2", train, valid, blocks=[2], upstream_from=[tmp_path / "b01"]
    )
    trainer.run(progress=False)
    assert trainer.stack is not None and len(trainer.units) == 1, "one block trained"
    assert trainer.stack.block_ids == [0, 1, 2], "beside it, frozen, the blocks it reads"
    info, model = load_model(tmp_path / "b2")
    assert info.blocks == [2]
    fresh = BlockStack(cfg.model, cfg.seed, [2])
    assert not torch.equal(model.block(2).head.weight, fresh.block(2).head.weight)
    assert torch.equal(model.targets, fresh.targets)


def test_resume_reproduces_the_uninterrupted_run(tmp_path, corpus):
    train, valid = splits(corpus)
    cfg = micro_config(steps=6, checkpoint_every=3)
    Trainer.create(cfg, tmp_path / "full", train, valid).run(progress=False)
    full = losses(tmp_path / "full")

    half = Trainer.create(cfg, tmp_path / "half", train, valid)
    half.run(progress=False, until=3)  # stop after step 3, as a crash or Ctrl-C would
    resumed = Trainer.resume(tmp_path / "half", train, valid)
    assert resumed.step == 3
    resumed.run(progress=False)
    stitched = losses(tmp_path / "half")
    assert len(full) == 6
    # Exact (tolerance 0) on purpose: both runs take `train_step` on the same shapes in this one
    # process, the checkpoint restores weights and AdamW moments losslessly, and the batches are
    # seeded by (seed, block, step). So rounding cannot differ; any difference is lost state.
    exact = {"rtol": 0.0, "atol": 0.0}
    torch.testing.assert_close(
        torch.tensor(stitched, dtype=torch.float64),
        torch.tensor(full, dtype=torch.float64),
        **exact,
        msg="resumed losses differ",
    )
    a = load_model(tmp_path / "full")[1].state_dict()
    b = load_model(tmp_path / "half")[1].state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], **exact, msg=lambda m, k=k: f"{k} after resume: {m}")


def test_reference_run_trains_and_loads(tmp_path, corpus):
    train, valid = splits(corpus)
    cfg = micro_config(steps=4, eval_every=2)
    summary = Trainer.create(cfg, tmp_path / "ref", train, valid, kind="reference").run(
        progress=False
    )
    assert summary["step"] == 4 and "ce" in summary["last_eval"]
    info, _ = load_model(tmp_path / "ref")
    assert info.kind == "reference"


def test_metrics_log_and_periodic_eval(tmp_path, corpus):
    train, valid = splits(corpus)
    Trainer.create(micro_config(steps=4, eval_every=2), tmp_path / "r", train, valid).run(
        progress=False
    )
    records = list(iter_metrics(tmp_path / "r"))
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    assert {"sampler_ce", "from_noise_ce", "ce_per_step", "oracle_ce"} <= set(evals[0])
    trains = [r for r in records if r["event"] == "train"]
    assert [r["step"] for r in trains] == [1, 2, 3, 4]
    assert all(r["bytes_per_s"] > 0 for r in trains)
    cfg_doc = json.loads((tmp_path / "r" / "config.json").read_text())
    assert cfg_doc["kind"] == "blocktrain" and cfg_doc["model"]["span"] == 2


def test_a_new_run_refuses_to_overwrite(tmp_path, corpus):
    train, valid = splits(corpus)
    Trainer.create(micro_config(steps=1), tmp_path / "r", train, valid).run(progress=False)
    with pytest.raises(BlockTrainError, match="already holds a run"):
        Trainer.create(micro_config(steps=1), tmp_path / "r", train, valid)


def test_corrupt_checkpoint_is_refused(tmp_path, corpus):
    train, valid = splits(corpus)
    Trainer.create(micro_config(steps=1), tmp_path / "r", train, valid).run(progress=False)
    (tmp_path / "r" / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError):
        load_model(tmp_path / "r")
    with pytest.raises(CheckpointError):
        Trainer.resume(tmp_path / "r", train, valid)


def test_a_relay_run_trains_each_block_on_the_clean_output_of_the_one_before(tmp_path, corpus):
    """route = relay in one process: one batch a step, block b reading block b-1's clean
    output of that very update (what its replica relays) rather than a rerun of the chain."""
    cfg = apply_overrides(micro_config(), ["route=relay"])
    trainer = Trainer.create(cfg, tmp_path / "run", load_split(corpus, "train"), None)
    assert trainer.stack is not None and trainer.relay is not None
    stack = trainer.stack
    before = {b: {k: v.clone() for k, v in stack.block(b).state_dict().items()} for b in range(3)}
    seen: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    relay = trainer.relay

    def spy(index: int, x: torch.Tensor) -> torch.Tensor | None:
        features = relay(index, x)
        seen[index] = (x.clone(), None if features is None else features.clone())
        return features

    for unit in trainer.units:
        unit.objective.func.upstream = spy  # type: ignore[attr-defined]
    trainer.train_step()
    x0, none = seen[0]
    assert none is None, "block 0 reads nothing"
    fresh = BlockStack(cfg.model, cfg.seed)
    fresh.load_state_dict(
        {f"blocks.{b}.{k}": v for b, sd in before.items() for k, v in sd.items()}
        | {"targets": stack.targets},
    )
    with torch.no_grad():
        want = None
        for b in (1, 2):
            x, features = seen[b]
            assert torch.equal(x, x0), "every block trains on the first one's batch"
            want = fresh.block(b - 1).clean_stream(x, want)
            assert features is not None
            # block b-1's clean output before its update: the weights at the start of the step
            assert torch.allclose(features, want, atol=1e-5), f"block {b} reads block {b - 1}"
    assert not features.requires_grad, "no gradient crosses a block"


def test_a_relay_run_trains_and_loads_as_a_features_model(tmp_path, corpus):
    cfg = apply_overrides(micro_config(), ["route=relay"])
    Trainer.create(cfg, tmp_path / "run", load_split(corpus, "train"), None).run(progress=False)
    _, stack = load_model(tmp_path / "run")
    assert isinstance(stack, BlockStack) and stack.cfg.route == "relay"
    assert stack.upstream(2, torch.zeros(1, 16, dtype=torch.long)) is not None, (
        "at inference a relay model reads the chain of clean streams, as a features model"
    )
