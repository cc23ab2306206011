"""The plan counts what training builds, without building it."""

from __future__ import annotations

from blocktrain.model import BlockStack, init_reference
from blocktrain.training.plan import plan
from tests.conftest import micro_config


def test_plan_counts_the_parameters_training_builds():
    cfg = micro_config()
    result = plan(cfg)
    stack = BlockStack(cfg.model, cfg.seed)
    built = [sum(p.numel() for p in stack.block(b).parameters()) for b in range(cfg.model.blocks)]
    assert result["params_per_block"] == built
    assert result["params_total"] == sum(built)
    reference = sum(p.numel() for p in init_reference(cfg.model, cfg.seed).parameters())
    assert result["reference_params"] == reference
    assert result["optimizer_state_bytes_worker"] == 8 * built[0], "two fp32 AdamW moments"
    assert len(result["block_training_intervals"]) == cfg.model.blocks
