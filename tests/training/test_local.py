"""The in-memory one-block trainer of a worker, and the assembly of per-block weights."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from blocktrain.config import ModelConfig, RunConfig, TrainConfig
from blocktrain.data import ByteCorpus, ByteSource
from blocktrain.errors import CheckpointError, ProtocolError
from blocktrain.model import init_block
from blocktrain.protocol.core.bounds import delta_norm_bound, token_bound
from blocktrain.relaystream import RelayStream
from blocktrain.training import EvalSettings, evaluate_blocktrain, load_model
from blocktrain.training.local import LocalBlockTrainer, build_stack, write_assembled

CFG = RunConfig(  # a features worker reads the blocks before it (relay: RELAY below)
    preset="micro",
    seed=3,
    model=ModelConfig(
        d_model=32, n_heads=2, layers=3, blocks=3, seq_len=16, span=2, route="features"
    ),
    train=TrainConfig(steps=20, batch_size=4, lr=3e-3, warmup_steps=2),
)


@pytest.fixture
def train_split(corpus):
    return ByteCorpus.open(corpus).split("train")


def init_weights(block: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in init_block(CFG.model, CFG.seed, block).state_dict().items()}


def worker_trainer(block: int, data: ByteSource, data_seed: int) -> LocalBlockTrainer:
    """A worker's trainer as a round starts: its block's version, and (route = features, the
    default) the versions of the blocks before it that it reads."""
    t = LocalBlockTrainer(CFG, block, data, data_seed=data_seed)
    t.load(init_weights(block))
    t.load_upstream({b: init_weights(b) for b in range(block)})
    return t


def test_train_moves_the_block_and_reports_tokens(train_split):
    t = worker_trainer(1, train_split, data_seed=7)
    assert all(float(d.abs().max()) == 0 for d in t.delta().values())
    logs = t.train(3, first_step=0)
    assert logs["steps"] == 3 and logs["tokens"] == 3 * 4 * 16 and math.isfinite(logs["loss"])
    delta = t.delta()
    norm = math.sqrt(sum(float(d.pow(2).sum()) for d in delta.values()))
    n_params = sum(d.numel() for d in delta.values())
    assert 0 < norm < delta_norm_bound(CFG, 3, n_params), "an honest delta is within the bound"
    assert token_bound(CFG, 3) >= logs["tokens"]


def test_adamw_state_carries_over_rounds(train_split):
    t = LocalBlockTrainer(CFG, 0, train_split, data_seed=7)
    t.load(init_weights(0))
    t.train(2, first_step=0)
    steps_before = [float(s["step"]) for s in t.optimizer.state.values()]
    t.load(init_weights(0))  # the next round's weights
    t.train(2, first_step=2)
    steps_after = [float(s["step"]) for s in t.optimizer.state.values()]
    assert steps_before and all(a == b + 2 for a, b in zip(steps_after, steps_before, strict=True))


def test_same_seed_same_delta_other_seed_other_batches(train_split):
    def run(seed: int) -> dict[str, torch.Tensor]:
        t = worker_trainer(2, train_split, data_seed=seed)
        t.train(2, first_step=4)
        return t.delta()

    a, b, c = run(11), run(11), run(12)
    assert all(torch.equal(a[k], b[k]) for k in a), "reproducible from the data seed"
    assert any(not torch.equal(a[k], c[k]) for k in a), "another replica sees other batches"


def test_stop_between_steps(train_split):
    t = LocalBlockTrainer(CFG, 0, train_split, data_seed=1)
    t.load(init_weights(0))
    calls = iter([False, True])
    assert t.train(5, 0, should_stop=lambda: next(calls))["steps"] == 1


def test_mismatched_weights_are_refused(train_split):
    t = LocalBlockTrainer(CFG, 0, train_split, data_seed=1)
    w = init_weights(0)
    with pytest.raises(ProtocolError, match="missing"):
        t.load({k: v for k, v in list(w.items())[1:]})
    name = next(iter(w))
    with pytest.raises(ProtocolError, match="shape"):
        t.load({**w, name: torch.zeros(1)})
    with pytest.raises(ProtocolError, match="load"):
        t.delta()
    with pytest.raises(ProtocolError):
        LocalBlockTrainer(CFG, 3, train_split, data_seed=1)


def test_assembled_run_folder_loads_and_evaluates(tmp_path, corpus):
    blocks = {b: {k: v + 0.001 * b for k, v in init_weights(b).items()} for b in range(3)}
    write_assembled(tmp_path / "run", CFG, blocks, step=40)
    info, model = load_model(tmp_path / "run")
    assert info.kind == "blocktrain" and info.blocks == [0, 1, 2]
    for b in range(3):
        for k, v in model.block(b).state_dict().items():
            assert torch.equal(v, blocks[b][k]), (b, k)
    windows = ByteCorpus.open(corpus).split("valid").windows(16, 64)
    ev = evaluate_blocktrain(model, windows, EvalSettings(sweeps=1, batch_size=4))
    assert math.isfinite(ev["from_noise_ce"])
    with pytest.raises(CheckpointError):
        build_stack(CFG, {0: blocks[0]})


RELAY = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, route="relay"))


def relay_trainer(block: int, data: ByteSource, **kw) -> LocalBlockTrainer:
    t = LocalBlockTrainer(RELAY, block, data, data_seed=5, **kw)
    t.load(init_weights(block))
    return t


def test_a_relay_replica_holds_its_block_only_and_relays_what_it_computed(train_split, tmp_path):
    first = relay_trainer(0, train_split, spool=tmp_path / "spool")
    assert first.upstream is None and first.upstream_blocks == [], "no weights of other blocks"
    assert (first.relays_from, first.relays_to) == (None, 1)
    block0 = init_block(RELAY.model, RELAY.seed, 0)
    first.train(3, first_step=0)
    body = first.stream_out({"round": "0", "worker": "1"})
    assert body is not None
    stream = RelayStream.from_body(body.read(), first.stream_shape())
    assert stream.steps == 3 and stream.metadata["block"] == "0"
    x, features = stream.step(0)
    with torch.no_grad():  # its first step's clean output, before that step's update
        want = block0.clean_stream(x)
    scale = want.abs().amax(-1, keepdim=True)
    assert bool(((features - want).abs() <= scale / 127).all()), "int8 of its own output"
    assert first.stream_out({}) is None, "one stream per round trained"

    second = relay_trainer(1, train_split)
    assert second.upstream is None and (second.relays_from, second.relays_to) == (0, 2)
    with pytest.raises(ProtocolError, match="load_stream"):
        second.train(1, first_step=0)
    second.load(init_weights(1))
    second.load_stream(stream)
    logs = second.train(4, first_step=0)  # more steps than the stream: it wraps
    assert logs["steps"] == 4 and logs["tokens"] == 4 * 4 * 16
    assert any(float(d.abs().max()) > 0 for d in second.delta().values())
    out = second.stream_out({"round": "1", "worker": "2"})
    assert out is not None and RelayStream.from_body(out.read()).steps == 4
    last = relay_trainer(2, train_split)
    assert last.relays_to is None, "the last block relays nothing"


def test_a_relay_replica_trains_on_the_stream_s_bytes_not_its_own(train_split, corpus):
    stream_source = relay_trainer(0, train_split)
    stream_source.train(2, first_step=0)
    body = stream_source.stream_out({})
    assert body is not None
    stream = RelayStream.from_body(body.read())
    # a replica reading other text would draw other batches, but it trains on the stream's
    a, b = relay_trainer(1, train_split), relay_trainer(1, ByteCorpus.open(corpus).split("valid"))
    for t in (a, b):
        t.load_stream(stream)
        t.train(2, first_step=0)
    for name, delta in a.delta().items():
        assert torch.allclose(delta, b.delta()[name]), name
    with pytest.raises(ProtocolError, match="does not fit"):
        other = LocalBlockTrainer(
            dataclasses.replace(RELAY, train=dataclasses.replace(RELAY.train, batch_size=2)),
            1,
            train_split,
            data_seed=1,
        )
        other.load_stream(stream)
