"""`Hostiles`: the trainers of one `Attack`'s workers in one simulation, built as the honest
workers' are (`simulate.run.trainer_factory`), with the deviation layered on top."""

from __future__ import annotations

from blocktrain.config import RunConfig
from blocktrain.data import ByteSource
from blocktrain.errors import ConfigError
from blocktrain.protocol.core.local_trainer import LocalTrainer, RelayTrainer
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.simulate.aggregator import Judged
from blocktrain.simulate.attacks.echoes import EchoTrainer, Watched, Witness
from blocktrain.simulate.attacks.forge import ForgingTrainer
from blocktrain.simulate.attacks.poison import poisoned
from blocktrain.simulate.attacks.probed import AscendTrainer, DriftTrainer
from blocktrain.simulate.attacks.spec import ECHOES, FORGED, POISONED, PROBED, Attack
from blocktrain.training.local import local_trainer
from blocktrain.training.probe import BlockProbe


class Hostiles:
    """What a `Simulation` needs of its attackers: attacker i's trainer (`trainer`), a view of
    the honest workers for the echoes (`watch` wraps each honest trainer, `judged` hears every
    verdict), and, for the probed kinds, one copy of the effect probe rebuilt from the public
    config and validation data as the aggregator builds it (`probe_skip`: where its slice
    starts). Fresh per simulation: the witness and the trainers' optimizers start empty."""

    def __init__(
        self,
        attack: Attack,
        cfg: RunConfig,
        settings: AggregatorSettings,
        train: ByteSource | None,
        valid: ByteSource | None,
        *,
        unit: str,
        n_workers: int,
        probe_skip: int,
        seed: int,
    ) -> None:
        if attack.trains and (train is None or valid is None):
            raise ConfigError(f"attack {attack.kind} trains: it needs the train and valid splits")
        if attack.kind in PROBED and unit != "block":
            raise ConfigError(f"attack {attack.kind} reads the effect probe, which judges blocks")
        self.attack = attack
        self.cfg = cfg
        self.settings = settings
        self.unit = unit
        self.n_workers = n_workers
        self.seed = seed
        self.witness = Witness() if attack.kind in ECHOES else None
        self._upstream: dict[int, list[int]] = {}  # block -> what its honest replica reads
        self._relays_from: dict[int, int | None] = {}  # block -> the stream it trains on
        self._train = train
        if attack.kind in POISONED:
            assert train is not None
            self._train = poisoned(attack.kind, train, cfg.seed)
        self._probe: BlockProbe | None = None
        if attack.kind in PROBED:
            assert valid is not None
            self._probe = BlockProbe(cfg, valid, skip_bytes=probe_skip)

    def watch(self, worker: int, block: int, trainer: LocalTrainer) -> LocalTrainer:
        """An honest worker's trainer, shown to the witness when the attack needs one."""
        self._upstream[block] = trainer.upstream_blocks
        if isinstance(trainer, RelayTrainer):
            self._relays_from[block] = trainer.relays_from
        return trainer if self.witness is None else Watched(trainer, self.witness, worker, block)

    def judged(self, judged: Judged) -> None:
        if self.witness is not None:
            self.witness.judged(judged)

    def trainer(self, i: int, worker: int, block: int) -> LocalTrainer:
        """Attacker i's trainer; `worker`: its id, which seeds its data as an honest worker's
        does (seed x n_workers + id)."""
        kind, settings = self.attack.kind, self.settings
        if kind in FORGED:
            return ForgingTrainer(kind, settings.max_delta_norm, settings.max_tokens, self.seed + i)
        if self.witness is not None:
            return EchoTrainer(
                kind,
                self.witness,
                block,
                self._upstream.get(block, []),
                self._relays_from.get(block),
            )
        assert self._train is not None
        inner = local_trainer(
            self.cfg,
            self.unit,
            block,
            self._train,
            data_seed=self.cfg.seed * self.n_workers + worker,
        )
        if kind in POISONED:
            return inner
        assert self._probe is not None
        rule = {"step": settings.probe_step, "z": settings.probe_z, "gain_z": settings.probe_gain_z}
        if kind == "drift":
            return DriftTrainer(inner, self._probe, settings.max_delta_norm, **rule)
        return AscendTrainer(
            inner, self._probe, settings.max_delta_norm, settings.max_tokens, **rule
        )
