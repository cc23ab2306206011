"""A BlockTrain block, `logits = block(x_bytes, z, sigma, layout)`: the denoiser of one noise
interval (the design, sections 2.2-2.4; docs/model.md, "A block"). Blocks share nothing
trainable, only the target table E, derived from the run's seed and never trained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blocktrain.config import VOCAB_SIZE, ModelConfig
from blocktrain.model.cached import CleanBatch
from blocktrain.model.layers import (
    AdaLN,
    DualStreamLayer,
    Rotary,
    modulate,
    sinusoidal_features,
)
from blocktrain.model.sigma import EDMScalings, edm_scalings

BOS = VOCAB_SIZE  # the extra embedding row a z token sees when no clean byte precedes its span


def target_table(seed: int, d_model: int) -> torch.Tensor:
    """E (256, d): seeded Gaussian rows, L2-normalised. Shared by every block and worker."""
    gen = torch.Generator().manual_seed(0x7A26E7 + seed)
    table = torch.randn(VOCAB_SIZE, d_model, generator=gen)
    return table / table.norm(dim=1, keepdim=True)


@dataclass(frozen=True)
class ZLayout:
    """Where the noisy tokens sit: positions (Lz,) and the start of each one's span (Lz,), plus
    the attention mask of the z queries over [clean keys (Lx), z keys (Lz)]."""

    z_pos: torch.Tensor
    span_start: torch.Tensor
    mask: torch.Tensor  # (Lz, Lx + Lz) bool, True = may attend

    @staticmethod
    def build(x_len: int, z_pos: torch.Tensor, span_start: torch.Tensor) -> ZLayout:
        """z_i sees clean x_j iff j < span_start_i, and z_j iff both share a span."""
        x_pos = torch.arange(x_len, device=z_pos.device)
        to_x = x_pos[None, :] < span_start[:, None]  # (Lz, Lx)
        to_z = span_start[:, None] == span_start[None, :]  # (Lz, Lz)
        return ZLayout(z_pos, span_start, torch.cat((to_x, to_z), dim=1))

    @staticmethod
    def training(seq_len: int, span: int, device: torch.device | str = "cpu") -> ZLayout:
        """Every position of a sequence denoised at once: spans of K bytes, z_i at position i."""
        pos = torch.arange(seq_len, device=device)
        return ZLayout.build(seq_len, pos, (pos // span) * span)

    @staticmethod
    def next_span(context_len: int, span: int, device: torch.device | str = "cpu") -> ZLayout:
        """One new span right after `context_len` clean bytes (generation)."""
        pos = torch.arange(context_len, context_len + span, device=device)
        return ZLayout.build(context_len, pos, torch.full_like(pos, context_len))


SIGMA_MEMO_SIZE = 64
"""Sigma values whose terms a block keeps (Block.sigma_terms): a grid has B * S points."""


@dataclass(frozen=True)
class SigmaTerms:
    """What a block's pass derives from sigma alone (Block.sigma_terms)."""

    scalings: EDMScalings
    layers: list[AdaLN]
    """Each layer's adaLN terms of the z stream."""
    final: tuple[torch.Tensor, torch.Tensor]
    """The final adaLN's shift and scale."""


class Block(nn.Module):
    """The denoiser of block b: D = c_skip * z + c_out * F(x, c_in * z, sigma), then adaLN and a
    zero-initialised head to byte logits. Optionally a next-byte head on the clean stream for the
    block-local auxiliary loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.sigma_data = cfg.sigma_data_value
        self.embed = nn.Embedding(VOCAB_SIZE + 1, d)  # + BOS
        nn.init.normal_(self.embed.weight, std=0.02)
        self.rotary = Rotary(cfg.head_dim)
        # Projection of c_in * z into the model; zero-initialised so that at the start the noise
        # (norm ~ sqrt(d) at high sigma) does not swamp what the z token knows (the design, section 2.9).
        self.z_in = nn.Linear(d, d)
        nn.init.zeros_(self.z_in.weight)
        nn.init.zeros_(self.z_in.bias)
        # sigma is one number per sequence: a narrow embedding of it drives every modulation,
        # which keeps the adaLN matrices at noise_dim x 6d instead of d x 6d per layer.
        nd = cfg.noise_dim
        self.noise_mlp = nn.Sequential(nn.Linear(nd, nd), nn.SiLU(), nn.Linear(nd, nd))
        depth_scale = 1.0 / math.sqrt(2 * cfg.layers_per_block)
        self.layers = nn.ModuleList(
            DualStreamLayer(
                d,
                cfg.n_heads,
                cfg.mlp_ratio,
                depth_scale,
                conditioned=True,
                gates_open=cfg.gates_open,
                cond_dim=nd,
            )
            for _ in range(cfg.layers_per_block)
        )
        self.out_proj = nn.Linear(d, d)  # F: the z stream's output, projected to d
        self.final_mod = nn.Linear(nd, 2 * d)  # final adaLN: shift, scale
        nn.init.zeros_(self.final_mod.weight)
        nn.init.zeros_(self.final_mod.bias)
        self.head = nn.Linear(d, VOCAB_SIZE)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self._sigma_memo: dict[tuple[tuple[float, ...], tuple[int, ...]], SigmaTerms] = {}
        self._sigma_params = [
            *self.noise_mlp.parameters(),
            *(p for layer in self.layers for p in layer.modulation.parameters()),  # type: ignore[union-attr]
            *self.final_mod.parameters(),
        ]
        self.aux_norm: nn.LayerNorm | None = None
        self.aux_head: nn.Linear | None = None
        if cfg.aux_weight > 0:
            self.aux_norm = nn.LayerNorm(d)
            self.aux_head = nn.Linear(d, VOCAB_SIZE)
            nn.init.zeros_(self.aux_head.weight)
            nn.init.zeros_(self.aux_head.bias)

    def forward(
        self,
        x_bytes: torch.Tensor,
        z: torch.Tensor,
        sigma: torch.Tensor,
        layout: ZLayout,
        *,
        with_aux: bool = False,
        upstream: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x_bytes (N, Lx) int64; z (N, Lz, d); sigma (N,) -> logits (N, Lz, 256), and the clean
        stream's next-byte logits (N, Lx, 256) when `with_aux` (else None). `upstream` (N, Lx,
        d): the previous block's clean output (`route = features`)."""
        logits, aux, _ = self.forward_with_clean(
            x_bytes, z, sigma, layout, with_aux=with_aux, upstream=upstream
        )
        return logits, aux

    def forward_with_clean(
        self,
        x_bytes: torch.Tensor,
        z: torch.Tensor,
        sigma: torch.Tensor,
        layout: ZLayout,
        *,
        with_aux: bool = False,
        upstream: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """`forward`, and the clean stream's output (N, Lx, d), what `clean_stream` returns:
        a replica relays it to the next block (`route = relay`) from its own training step."""
        x_len = x_bytes.shape[1]
        sc, cond = self.conditioning(sigma.to(z.dtype))

        x = self.clean_input(x_bytes, upstream)  # (N, Lx, d)
        h = self.z_tokens(x_bytes, z, sc.c_in, layout, upstream)  # (N, Lz, d)

        rope_x = self.rotary.rotation(torch.arange(x_len, device=x_bytes.device))
        rope_z = self.rotary.rotation(layout.z_pos)
        for layer in self.layers:
            x, h_out = layer(x, rope_x, h, cond, rope_z, layout.mask)
            assert h_out is not None
            h = h_out

        logits = self.readout(h, z, sc, self.final_adaln(cond))
        aux = None
        if with_aux and self.aux_head is not None and self.aux_norm is not None:
            aux = self.aux_head(self.aux_norm(x))  # (N, Lx, 256): predicts byte i + 1
        return logits, aux, x

    def clean_input(self, x_bytes: torch.Tensor, upstream: torch.Tensor | None) -> torch.Tensor:
        """The clean stream's input (N, Lx, d): the byte embeddings, plus the previous block's
        clean output when the run passes features (`route = features`)."""
        x = self.embed(x_bytes)
        return x if upstream is None else x + upstream

    def clean_stream(
        self, x_bytes: torch.Tensor, upstream: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The clean stream alone: x_bytes (N, Lx) -> its last residual (N, Lx, d); it depends
        on the context only, never on z or sigma."""
        x = self.clean_input(x_bytes, upstream)
        rope_x = self.rotary.rotation(torch.arange(x_bytes.shape[1], device=x_bytes.device))
        for layer in self.layers:
            x, _ = layer(x, rope_x)
        return x

    def conditioning(self, sigma: torch.Tensor) -> tuple[EDMScalings, torch.Tensor]:
        """sigma (N,) -> (the EDM scalings, the noise embedding (N, nd) that drives adaLN)."""
        sc = edm_scalings(sigma, self.sigma_data)
        return sc, self.noise_mlp(sinusoidal_features(sc.c_noise, self.cfg.noise_dim))

    def final_adaln(self, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The final adaLN's shift and scale (N, d) from the noise embedding cond."""
        shift, scale = self.final_mod(F.silu(cond)).chunk(2, dim=-1)
        return shift, scale

    def readout(
        self,
        h: torch.Tensor,
        z: torch.Tensor,
        sc: EDMScalings,
        final: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """The z stream's last hidden states h (N, Lz, d) -> logits (N, Lz, 256): D = c_skip *
        z + c_out * F, then the final adaLN (`final_adaln`) and the head."""
        f = self.out_proj(F.layer_norm(h, h.shape[-1:]))  # (N, Lz, d)
        denoised = sc.c_skip[:, None, None] * z + sc.c_out[:, None, None] * f
        return self.head(modulate(F.layer_norm(denoised, denoised.shape[-1:]), *final))

    def sigma_terms(self, sigma: torch.Tensor) -> SigmaTerms:
        """Everything a pass derives from sigma (N,) alone, for inference (the EDM scalings, the
        adaLN terms), memoised: a host calls its blocks at the same few grid sigmas on every
        sweep, and these terms showed in a py-spy profile. The key holds the parameters'
        versions, so weights loaded or trained in place are never served stale terms."""
        params = self._sigma_params
        key = (tuple(sigma.tolist()), tuple(p._version for p in params))
        terms = self._sigma_memo.get(key)
        if terms is None:
            if len(self._sigma_memo) >= SIGMA_MEMO_SIZE:
                self._sigma_memo.clear()
            sc, cond = self.conditioning(sigma)
            layers = [layer.adaln(cond) for layer in self.layers]  # type: ignore[operator]
            terms = SigmaTerms(sc, layers, self.final_adaln(cond))
            self._sigma_memo[key] = terms
        return terms

    def forward_cached(
        self,
        x_bytes: torch.Tensor,
        z: torch.Tensor,
        sigma: torch.Tensor,
        layout: ZLayout,
        clean: CleanBatch,
        upstream: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward`'s logits (N, Lz, 256) with the clean stream taken from `clean` (right-aligned
        contexts, model/cached.py): only its last `clean.fresh` indices run through the layers,
        and they are left in `clean` (outputs in `clean.out`) for the next call. x_bytes (N, Lx),
        Lx = clean.length; `upstream` (N, Lx, d) right-aligned (`route = features`)."""
        length, fresh = x_bytes.shape[1], clean.fresh
        assert length == clean.length and len(clean.keys) == len(self.layers)
        terms = self.sigma_terms(sigma.to(z.dtype))
        sc = terms.scalings
        h = self.z_tokens(x_bytes, z, sc.c_in, layout, upstream)  # (N, Lz, d)
        n = x_bytes.shape[0]
        # Per-row positions (index less the row's padding): rotations (N, 1, L, hd/2).
        rope_z = self.rotary.rotation(clean.positions(layout.z_pos).flatten())
        rope_z = rope_z.view(n, 1, -1, rope_z.shape[-1])
        z_mask = clean.z_mask(layout.mask)
        x: torch.Tensor | None = None
        rope_x = x_mask = torch.empty(0)
        if fresh:
            index = torch.arange(length - fresh, length, device=x_bytes.device)
            above = None if upstream is None else upstream[:, length - fresh :]
            x = self.clean_input(x_bytes[:, length - fresh :], above)  # (N, fresh, d)
            rope_x = self.rotary.rotation(clean.positions(index).flatten())
            rope_x = rope_x.view(n, 1, fresh, rope_x.shape[-1])
            x_mask = clean.clean_mask()
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DualStreamLayer)
            x, (clean.keys[i], clean.values[i]), h = layer.cached_step(
                x,
                rope_x,
                (clean.keys[i], clean.values[i]),
                x_mask,
                h,
                terms.layers[i],
                rope_z,
                z_mask,
                # The last layer's clean MLP feeds nothing the logits read; only the next block.
                clean_mlp=i < last or clean.out is not None,
            )
        if clean.out is not None and x is not None:
            clean.out[:, length - fresh :] = x
        clean.fresh = 0
        return self.readout(h, z, sc, terms.final)

    def z_tokens(
        self,
        x_bytes: torch.Tensor,
        z: torch.Tensor,
        c_in: torch.Tensor,
        layout: ZLayout,
        upstream: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The z stream's input tokens (N, Lz, d): the projected c_in * z, plus the clean
        embedding of the last byte each z token may see (BOS before the first span), plus the
        upstream features (N, Lx, d) at that byte when given."""
        h = self.z_in(c_in[:, None, None] * z)
        last = layout.span_start - 1  # (Lz,)
        if self.cfg.z_prev_byte:
            prev = torch.where(last >= 0, x_bytes[:, last.clamp(min=0)], BOS)  # (N, Lz)
            h = h + self.embed(prev)
        if upstream is not None:
            seen = (last >= 0)[None, :, None]
            h = h + torch.where(seen, upstream[:, last.clamp(min=0)], 0.0)
        return h
