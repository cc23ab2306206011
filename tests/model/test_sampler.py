import itertools

import pytest
import torch

from blocktrain.config import ModelConfig
from blocktrain.model import (
    BlockStack,
    Reference,
    Sampling,
    SigmaSchedule,
    ZLayout,
    generate,
    generate_autoregressive,
    one_sweep,
    sample_bytes,
    stack_denoiser,
)

CFG = ModelConfig(d_model=32, n_heads=2, layers=3, blocks=3, seq_len=16, span=2)


def lively_stack(cfg: ModelConfig = CFG) -> BlockStack:
    """A stack whose logits depend on the context, z and sigma: the zero-initialised heads,
    projections and modulations of a fresh block get random weights (a fresh block's logits are
    all zero, so a context or state bug could not show)."""
    stack = BlockStack(cfg, seed=0).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in stack.parameters():
            if not p.any():
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return stack


def next_byte_denoiser(calls: list | None = None):
    """A denoiser certain that the byte at position p of a span is (last context byte + 1 +
    offset of p in its span) mod 256: greedy generation must count up from the prompt's last
    byte, whatever K, so the context window, the positions and the appends all show."""

    def denoise(b, x, z, sigma, layout):
        last = x[:, -1]  # (N,)
        offset = layout.z_pos - layout.span_start  # (Lz,)
        want = (last[:, None] + 1 + offset[None, :]) % 256  # (N, Lz)
        logits = torch.full((*want.shape, 256), -30.0)
        logits.scatter_(-1, want[..., None], 30.0)
        if calls is not None:
            calls.append(x.shape[1])
        return logits

    return denoise


def recording_denoiser(calls):
    def denoise(b, x, z, sigma, layout):
        calls.append((b, float(sigma[0])))
        return torch.zeros(*z.shape[:2], 256)

    return denoise


def test_one_sweep_with_one_step_per_block_calls_each_block_once_in_order():
    calls: list = []
    grid = SigmaSchedule.from_config(CFG).sampler_grid(1)
    targets = torch.eye(256, 32)
    layout = ZLayout.next_span(4, 2)
    one_sweep(
        recording_denoiser(calls),
        torch.zeros(1, 4, dtype=torch.long),
        torch.randn(1, 2, 32),
        grid,
        targets,
        layout,
    )
    assert [b for b, _ in calls] == [0, 1, 2]
    assert calls[0][1] == 10.0 and calls[-1][1] == 1.0


def test_steps_per_block_gives_consecutive_calls():
    calls: list = []
    grid = SigmaSchedule.from_config(CFG).sampler_grid(3)
    one_sweep(
        recording_denoiser(calls),
        torch.zeros(1, 4, dtype=torch.long),
        torch.randn(1, 2, 32),
        grid,
        torch.eye(256, 32),
        ZLayout.next_span(4, 2),
    )
    assert [b for b, _ in calls] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_euler_moves_towards_a_confident_prediction():
    """With logits certain of byte 7, the state lands on E[7] scaled as the ODE says."""
    targets = torch.nn.functional.normalize(torch.randn(256, 32), dim=1)
    logits = torch.full((1, 1, 256), -1e4)
    logits[..., 7] = 0

    def denoise(b, x, z, sigma, layout):
        return logits

    z0 = torch.randn(1, 1, 32) * 10
    grid = [(0, 10.0), (1, 1.0), (2, 1.0)]
    zs = []
    one_sweep(
        denoise,
        torch.zeros(1, 1, dtype=torch.long),
        z0,
        grid,
        targets,
        ZLayout.next_span(1, 1),
        on_step=lambda n, b, s, lg: zs.append(n),
    )
    # one Euler step from sigma 10 to 1: z1 = z0 - 0.9 (z0 - E[7]) = 0.1 z0 + 0.9 E[7]
    from blocktrain.model import euler_step

    z1 = euler_step(z0, logits, targets, 10.0, 1.0)
    torch.testing.assert_close(z1, 0.1 * z0 + 0.9 * targets[7])
    assert zs == [0, 1, 2]


@pytest.mark.parametrize("span", [1, 2, 4])
def test_generate_continues_from_the_context_it_has_produced(span):
    calls: list[int] = []
    grid = SigmaSchedule.from_config(CFG).sampler_grid(1)
    out = generate(
        next_byte_denoiser(calls),
        torch.tensor([[60, 61, 62]]),
        20,
        grid=grid,
        targets=torch.nn.functional.normalize(torch.randn(256, 32), dim=1),
        span=span,
        max_context=CFG.seq_len - span,
        sampling=Sampling(temperature=0),
        generator=torch.Generator().manual_seed(0),
    )
    assert out[0].tolist() == list(range(63, 83)), "each span follows the bytes before it"
    assert len(calls) == 3 * -(-20 // span), "one sweep of B = 3 calls per span"
    seen, cap = calls[::3], CFG.seq_len - span  # one context length per sweep
    assert max(seen) <= cap, "the window never holds more than T - K bytes"
    for before, after in itertools.pairwise(seen):
        # The window stands still and grows by a span (the hosts' caches hold), or restarts
        # at the last (T - K) // 2 bytes once the next span would not fit.
        assert after == before + span or (after == cap // 2 and before + span > cap), seen
    assert cap // 2 in seen[1:], f"20 bytes outgrow the window, which restarts: {seen}"


def test_a_sweep_split_into_ranges_of_points_is_the_whole_sweep():
    """What the block hosts do: each runs its consecutive points and hands z on."""
    from blocktrain.model.sampler import run_points

    stack = lively_stack()
    grid = SigmaSchedule.from_config(CFG).sampler_grid(2)  # 6 points
    x = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    z = 10 * torch.randn(2, 2, 32, generator=torch.Generator().manual_seed(1))
    layout = ZLayout.next_span(5, 2)
    den = stack_denoiser(stack)
    for method in ("euler", "ancestral"):
        whole = one_sweep(
            den,
            x,
            z,
            grid,
            stack.targets,
            layout,
            method=method,
            generator=torch.Generator().manual_seed(2),
        )
        gen = torch.Generator().manual_seed(2)
        state = z
        for start, stop in [(0, 1), (1, 4), (4, 6)]:
            state, logits = run_points(
                den,
                x,
                state,
                grid,
                stack.targets,
                layout,
                start=start,
                stop=stop,
                method=method,
                generator=gen,
            )
        # Same code, same shapes, same order of random draws: exact.
        assert torch.equal(logits, whole), method
    other = one_sweep(den, x, z, grid, stack.targets, layout)
    moved = one_sweep(den, x, z + 1, grid, stack.targets, layout)
    assert not torch.allclose(other, moved), "the state reaches the logits"
    with pytest.raises(ValueError, match="do not lie in"):
        run_points(den, x, z, grid, stack.targets, layout, start=4, stop=7)


@pytest.mark.parametrize("n", [1, 5, 8])
def test_generate_returns_the_requested_number_of_bytes(n):
    stack = lively_stack()
    grid = SigmaSchedule.from_config(CFG).sampler_grid(1)
    out = generate(
        stack_denoiser(stack),
        torch.tensor([[65, 66, 67]]),
        n,
        grid=grid,
        targets=stack.targets,
        span=CFG.span,
        max_context=CFG.seq_len - CFG.span,
        sampling=Sampling(),
        generator=torch.Generator().manual_seed(0),
    )
    assert out.shape == (1, n) and out.dtype == torch.long
    assert int(out.min()) >= 0 and int(out.max()) < 256


def test_generate_is_seeded_and_handles_contexts_longer_than_training():
    stack = lively_stack()
    grid = SigmaSchedule.from_config(CFG).sampler_grid(1)
    prompt = torch.randint(0, 256, (1, 40))

    def go(seed):
        return generate(
            stack_denoiser(stack),
            prompt,
            20,
            grid=grid,
            targets=stack.targets,
            span=CFG.span,
            max_context=CFG.seq_len - CFG.span,
            sampling=Sampling(),
            generator=torch.Generator().manual_seed(seed),
        )

    assert torch.equal(go(1), go(1))
    assert not torch.equal(go(1), go(2))


def test_autoregressive_generation_length():
    model = Reference(CFG).eval()
    out = generate_autoregressive(
        model,
        torch.tensor([[1, 2]]),
        30,
        seq_len=CFG.seq_len,
        sampling=Sampling(),
        generator=torch.Generator().manual_seed(0),
    )
    assert out.shape == (1, 30)


def test_sampling_modes():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0] + [-1e9] * 252])
    gen = torch.Generator().manual_seed(0)
    assert int(sample_bytes(logits, Sampling(temperature=0), gen)) == 1
    draws = {int(sample_bytes(logits, Sampling(top_k=2), gen)) for _ in range(200)}
    assert draws == {1, 3}
    draws = {int(sample_bytes(logits, Sampling(top_p=0.5), gen)) for _ in range(200)}
    assert draws == {1}, "the top byte alone holds over half the mass"
    draws = {int(sample_bytes(logits, Sampling(), gen)) for _ in range(500)}
    assert draws == {0, 1, 2, 3}
    with pytest.raises(ValueError):
        Sampling(top_p=0)
    with pytest.raises(ValueError):
        Sampling(temperature=-1)


def test_ancestral_step_renoises_around_a_sampled_target():
    from blocktrain.model.sampler import ancestral_step

    targets = torch.nn.functional.normalize(torch.randn(256, 32), dim=1)
    logits = torch.full((2, 3, 256), -1e4)
    logits[..., 42] = 0  # certain of byte 42
    z = ancestral_step(logits, targets, 0.5, torch.Generator().manual_seed(0))
    noise = (z - targets[42]) / 0.5
    assert z.shape == (2, 3, 32)
    assert abs(float(noise.std()) - 1.0) < 0.3, "fresh noise at the next sigma"


def test_ancestral_sweep_is_seeded_and_needs_a_generator():
    stack = lively_stack()
    grid = SigmaSchedule.from_config(CFG).sampler_grid(2)
    x = torch.randint(0, 256, (1, 4))
    z = torch.randn(1, 2, 32)
    layout = ZLayout.next_span(4, 2)
    den = stack_denoiser(stack)

    def run(seed):
        return one_sweep(
            den,
            x,
            z,
            grid,
            stack.targets,
            layout,
            method="ancestral",
            generator=torch.Generator().manual_seed(seed),
        )

    assert torch.equal(run(3), run(3))
    assert not torch.equal(run(3), run(4)), "the re-noising draws from the generator"
    with pytest.raises(ValueError, match="generator"):
        one_sweep(den, x, z, grid, stack.targets, layout, method="ancestral")
    with pytest.raises(ValueError, match="unknown sampler"):
        one_sweep(den, x, z, grid, stack.targets, layout, method="heun")
