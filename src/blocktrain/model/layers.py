"""Transformer pieces shared by the blocks and the end-to-end reference: one layer runs the
clean stream x and the noise-conditioned stream z (docs/model.md, "A block"). Nothing attends
from x to z, so the clean stream does not depend on z or sigma: the reference is the clean
stream alone, and at inference its keys and values are cached (model/cached.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Rotary(nn.Module):
    """Rotary position embedding (RoFormer, Su et al. 2021, arXiv 2104.09864), in the
    interleaved-pair form: each pair (t[2i], t[2i+1]) is one complex number, rotated by one
    complex multiplication (a single kernel forward and backward)."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (L,) -> unit complex rotations (L, head_dim/2); cheap, so not cached."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # (L, hd/2)
        return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(t: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """t (N, H, L, hd) real, rot (L, hd/2) complex -> t rotated pairwise, same shape/dtype."""
    pairs = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))  # (N, H, L, hd/2)
    return torch.view_as_real(pairs * rot).flatten(-2).to(t.dtype)


def modulate(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: h (N, L, d) * (1 + scale) + shift, with shift/scale (N, d) per sequence."""
    return torch.addcmul(shift[:, None, :], h, 1 + scale[:, None, :])


AdaLN = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""A layer's adaLN terms for the z stream (DualStreamLayer.adaln), each (N, d)."""


class DualStreamLayer(nn.Module):
    """One pre-norm Transformer layer applied to the clean stream and, optionally, to the
    noise-conditioned stream. With `conditioned=False` it is a plain causal layer (the
    reference)."""

    def __init__(
        self,
        d: int,
        n_heads: int,
        mlp_ratio: int,
        depth_scale: float,
        conditioned: bool,
        gates_open: bool,
        cond_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.gates_open = gates_open
        self.ln1 = nn.LayerNorm(d)
        self.ln2 = nn.LayerNorm(d)
        # No biases in the matrix layers (as in PaLM and LLaMA): on CPU a bias costs a full
        # extra pass over every output (addmm first copies it in), for no gain in quality.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc1 = nn.Linear(d, mlp_ratio * d, bias=False)
        self.fc2 = nn.Linear(mlp_ratio * d, d, bias=False)
        for lin in (self.qkv, self.fc1):
            nn.init.normal_(lin.weight, std=0.02)
        for lin in (self.proj, self.fc2):  # residual outputs shrink with depth (GPT-2)
            nn.init.normal_(lin.weight, std=0.02 * depth_scale)
        # adaLN-Zero: shift, scale, gate for the attention and the MLP branch of the z stream,
        # from the noise embedding; zero-initialised so every block starts unconditioned.
        self.modulation: nn.Linear | None = None
        if conditioned:
            self.modulation = nn.Linear(cond_dim or d, 6 * d)
            nn.init.zeros_(self.modulation.weight)
            nn.init.zeros_(self.modulation.bias)

    def _heads(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, length, d = h.shape
        qkv = self.qkv(h).view(n, length, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (N, H, L, hd)
        return q, k, v

    def _merge(self, a: torch.Tensor) -> torch.Tensor:
        n, heads, length, hd = a.shape
        return self.proj(a.transpose(1, 2).reshape(n, length, heads * hd))  # (N, L, d)

    def attend_clean(
        self,
        x: torch.Tensor,
        rot: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The clean stream's causal attention with its residual, for L new positions after P
        cached ones: x (N, L, d), rot (L, hd/2) (or (N, 1, L, hd/2) per row), past the cached
        (k, v), each (N, H, P, hd), or None -> (x, (k, v) each (N, H, P + L, hd), rotated).
        `mask` (N, 1, L, P + L), bool or additive, replaces the causal mask (padded rows)."""
        q, k, v = self._heads(self.ln1(x))  # each (N, H, L, hd)
        q, k = apply_rotary(q, rot), apply_rotary(k, rot)
        if mask is not None:
            if past is not None:
                k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif past is None:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
            new, total = q.shape[2], k.shape[2]
            if new == 1:  # the usual decoding step: the one new token sees everything
                attn = F.scaled_dot_product_attention(q, k, v)
            else:  # new token i sits at position P + i and sees keys 0..P + i
                key_pos = torch.arange(total, device=x.device)
                query_pos = torch.arange(total - new, total, device=x.device)
                mask = key_pos[None, :] <= query_pos[:, None]  # (L, P + L)
                attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self._merge(attn), (k, v)

    def mlp_clean(self, x: torch.Tensor) -> torch.Tensor:
        """The clean stream's MLP with its residual: x (N, L, d) -> (N, L, d)."""
        return x + self._mlp(self.ln2(x))

    def forward(
        self,
        x: torch.Tensor,
        rope_x: torch.Tensor,
        z: torch.Tensor | None = None,
        cond: torch.Tensor | None = None,
        rope_z: torch.Tensor | None = None,
        z_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (N, Lx, d) clean; z (N, Lz, d) noisy or None; cond (N, cond_dim) noise embedding;
        rope_x / rope_z the rotations of their positions (Rotary.rotation); z_mask
        (Lz, Lx + Lz) bool, True where a z query may attend."""
        # --- attention ---
        x, (kx, vx) = self.attend_clean(x, rope_x)
        if z is None:
            return self.mlp_clean(x), None
        assert cond is not None and rope_z is not None
        z = self.noisy(z, (kx, vx), self.adaln(cond), rope_z, z_mask)
        return self.mlp_clean(x), z

    def adaln(self, cond: torch.Tensor) -> AdaLN:
        """The z stream's adaLN terms from the noise embedding cond (N, cond_dim): shift, scale
        and gate of the attention branch, then of the MLP branch, each (N, d)."""
        assert self.modulation is not None
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(F.silu(cond)).chunk(
            6, dim=-1
        )
        if self.gates_open:
            gate1, gate2 = 1 + gate1, 1 + gate2
        return shift1, scale1, gate1, shift2, scale2, gate2

    def noisy(
        self,
        z: torch.Tensor,
        clean: tuple[torch.Tensor, torch.Tensor],
        terms: AdaLN,
        rope_z: torch.Tensor,
        z_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The z stream's attention and MLP with their residuals: z (N, Lz, d), clean the
        rotated (k, v) of the clean stream, each (N, H, Lx, hd) (this layer's, fresh or from a
        cache), terms its adaLN terms (`adaln`), rope_z (Lz, hd/2) or (N, 1, Lz, hd/2), z_mask
        (Lz, Lx + Lz) or (N, 1, Lz, Lx + Lz) -> z (N, Lz, d). The clean stream never reads it."""
        shift1, scale1, gate1, shift2, scale2, gate2 = terms
        hz = modulate(F.layer_norm(z, z.shape[-1:]), shift1, scale1)
        qz, kz, vz = self._heads(hz)
        qz, kz = apply_rotary(qz, rope_z), apply_rotary(kz, rope_z)
        # z queries see the clean keys before their span and the z keys of their span.
        kx, vx = clean
        az = F.scaled_dot_product_attention(
            qz, torch.cat((kx, kz), dim=2), torch.cat((vx, vz), dim=2), attn_mask=z_mask
        )
        z = torch.addcmul(z, gate1[:, None, :], self._merge(az))
        hz = modulate(F.layer_norm(z, z.shape[-1:]), shift2, scale2)
        return torch.addcmul(z, gate2[:, None, :], self._mlp(hz))

    def cached_step(
        self,
        x: torch.Tensor | None,
        rope_x: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor],
        x_mask: torch.Tensor,
        z: torch.Tensor,
        terms: AdaLN,
        rope_z: torch.Tensor,
        z_mask: torch.Tensor,
        *,
        clean_mlp: bool = True,
    ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """`attend_clean` (and `mlp_clean` when clean_mlp) on the fresh clean positions x
        (N, L, d), or None when the cache holds them all, then `noisy` on z (N, Lz, d), as in
        Block.forward_cached, with the two streams' rows in one matrix product per weight: at
        inference the rows are few and each product costs about a read of its weights, so one
        read serves both streams. -> (x, the clean (k, v) with x's appended, z)."""
        shift1, scale1, gate1, shift2, scale2, gate2 = terms
        n_x = 0 if x is None else x.shape[1]
        hz = modulate(F.layer_norm(z, z.shape[-1:]), shift1, scale1)
        rows = hz if x is None else torch.cat((self.ln1(x), hz), dim=1)
        q, k, v = self._heads(rows)  # each (N, H, L + Lz, hd)
        qz, kz, vz = q[:, :, n_x:], k[:, :, n_x:], v[:, :, n_x:]
        kx, vx = past
        merged = []
        if x is not None:
            qx, kx_new = apply_rotary(q[:, :, :n_x], rope_x), apply_rotary(k[:, :, :n_x], rope_x)
            kx, vx = torch.cat((kx, kx_new), dim=2), torch.cat((vx, v[:, :, :n_x]), dim=2)
            merged.append(F.scaled_dot_product_attention(qx, kx, vx, attn_mask=x_mask))
        qz, kz = apply_rotary(qz, rope_z), apply_rotary(kz, rope_z)
        merged.append(
            F.scaled_dot_product_attention(
                qz, torch.cat((kx, kz), dim=2), torch.cat((vx, vz), dim=2), attn_mask=z_mask
            )
        )
        out = self._merge(torch.cat(merged, dim=2))  # (N, L + Lz, d)
        z = torch.addcmul(z, gate1[:, None, :], out[:, n_x:])
        hz = modulate(F.layer_norm(z, z.shape[-1:]), shift2, scale2)
        if x is not None:
            x = x + out[:, :n_x]
        if x is None or not clean_mlp:
            return x, (kx, vx), torch.addcmul(z, gate2[:, None, :], self._mlp(hz))
        out = self._mlp(torch.cat((self.ln2(x), hz), dim=1))
        return x + out[:, :n_x], (kx, vx), torch.addcmul(z, gate2[:, None, :], out[:, n_x:])

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(h)))


def sinusoidal_features(values: torch.Tensor, dim: int) -> torch.Tensor:
    """values (N,) -> (N, dim) sin/cos features at geometric frequencies (Transformer / EDM)."""
    half = dim // 2
    freqs = torch.exp(
        -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=values.device) / half
    )
    angles = values.to(torch.float32)[:, None] * freqs[None, :] * 100.0
    return torch.cat((angles.cos(), angles.sin()), dim=-1)
