"""The single-machine asynchronous simulator (the BlockTrain design, section 5; docs/simulate.md): virtual workers with drawn
compute times, latencies, bandwidths and dropouts, on a virtual clock, against the protocol's own
round state machine, validators and aggregation."""

from blocktrain.simulate.aggregator import SimAggregator
from blocktrain.simulate.engine import Simulation
from blocktrain.simulate.regimes import REGIMES, Dist, Regime, load_regime, parse_regimes
from blocktrain.simulate.run import SimSpec, simulate, write_outputs
from blocktrain.simulate.workers import TimingOnlyTrainer

__all__ = [
    "REGIMES",
    "Dist",
    "Regime",
    "SimAggregator",
    "SimSpec",
    "Simulation",
    "TimingOnlyTrainer",
    "load_regime",
    "parse_regimes",
    "simulate",
    "write_outputs",
]
