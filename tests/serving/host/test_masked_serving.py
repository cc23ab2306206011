"""A masked run (`process = masked`) served through the real chain: block hosts and the router run
the reveal sampler, the state on the wire stays z = E[y] or 0, and the text is the very text
`blocktrain generate` writes for the same request; Gaussian samplers are refused with a 400."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from blocktrain.data import load_split
from blocktrain.model import BlockStack, Sampling
from blocktrain.serving import HostSettings, ModelSource, create_host_app
from blocktrain.training import Trainer, load_model
from tests.conftest import TEXT, micro_config
from tests.serving.conftest import URLS, Apps, Cluster, Runs, in_process


@pytest.fixture(scope="module")
def masked_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("masked-run")
    (root / "corpus").mkdir()
    (root / "corpus" / "wiki.train.raw").write_text(TEXT * 40)
    cfg = micro_config(steps=3)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, span=4, process="masked"))
    train = load_split(root / "corpus", "train")
    Trainer.create(cfg, root / "run", train, None, kind="blocktrain").run(progress=False)
    return root / "run"


@pytest.fixture(scope="module")
def masked_stack(masked_run: Path) -> BlockStack:
    _, model = load_model(masked_run)
    assert isinstance(model, BlockStack) and model.cfg.process == "masked"
    return model


def masked_cluster(run: Path) -> Cluster:
    apps = Apps()
    for i, url in enumerate(URLS):
        settings = HostSettings(models=(ModelSource("mk", run),), parts=(i,), public_url=url)
        apps.apps[url] = create_host_app(settings, transport=apps)
    return Cluster(apps, URLS, Runs(run, run, run, run, run, run))


@pytest.mark.parametrize("sample_on", ["router", "last-host"])
@pytest.mark.parametrize("steps", [1, 2])
def test_the_chain_writes_what_generate_writes(masked_run, masked_stack, sample_on, steps):
    request = {
        "model": "mk",
        "prompt": "The game ",
        "max_bytes": 10,
        "seed": 5,
        "temperature": 0.8,
        "top_k": 40,
        "steps_per_block": steps,
    }
    with masked_cluster(masked_run).router(sample_on=sample_on) as router:
        r = router.post("/v1/generate", json=request)
    assert r.status_code == 200, r.text
    expected = in_process(
        masked_stack,
        b"The game ",
        10,
        5,
        Sampling(temperature=0.8, top_k=40),
        steps_per_block=steps,
        sampler="reveal",
    )
    assert r.json()["bytes"] == expected
    # The request's sampling reaches every round: greedy text differs from this one.
    greedy = in_process(
        masked_stack, b"The game ", 10, 5, Sampling(temperature=0), steps, sampler="reveal"
    )
    assert greedy != expected


def test_gaussian_samplers_are_refused_with_one_clear_line(masked_run):
    with masked_cluster(masked_run).router() as router:
        for sampler in ("euler", "ancestral"):
            r = router.post(
                "/v1/generate",
                json={"model": "mk", "prompt": "ab", "max_bytes": 3, "sampler": sampler},
            )
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "sampler"
            assert f"the {sampler} sampler does not run a masked model" in err["message"]
            assert "\n" not in err["message"]
        ok = router.post(
            "/v1/completions",
            json={"model": "mk", "prompt": "ab", "max_tokens": 3, "sampler": "reveal"},
        )
        assert ok.status_code == 200, ok.text


def test_reveal_is_refused_for_a_gaussian_model(router):
    r = router.post(
        "/v1/generate", json={"model": "bt", "prompt": "ab", "max_bytes": 3, "sampler": "reveal"}
    )
    assert r.status_code == 400, r.text
    assert "the reveal sampler does not run a gaussian model" in r.json()["error"]["message"]
