import blocktrain

EXPECTED = {
    "Block",
    "BlockStack",
    "BlockTrainError",
    "ByteCorpus",
    "ByteSource",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "EvalSettings",
    "ModelConfig",
    "Reference",
    "RunConfig",
    "Sampling",
    "SigmaSchedule",
    "TrainConfig",
    "Trainer",
    "__version__",
    "apply_overrides",
    "evaluate_blocktrain",
    "from_pretrained",
    "generate",
    "load_model",
    "load_split",
    "preset",
}


def test_public_api_is_exactly_what_we_promise():
    assert set(blocktrain.__all__) == EXPECTED, "changing the public API is a decision: update both"
    for name in EXPECTED:
        assert hasattr(blocktrain, name), name
