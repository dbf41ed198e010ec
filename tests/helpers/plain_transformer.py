"""A small decoder-only transformer written in plain PyTorch, for tests.

It is the "user-written model" the backend must handle without any
model-family binding: embedding, pre-norm blocks with hand-written RoPE and
`F.scaled_dot_product_attention`, a GELU MLP and an untied LM head. Options
cover the attention spellings seen in the wild (native GQA, HF-style
`repeat_kv`, `repeat_interleave`, an explicit boolean causal mask) and one
unsupported position-mixing operator (`torch.cumsum` over the sequence) for
the error tests.

Everything is computed in the parameters' dtype (no float32 up-casts), so
float64 parity against eager is ~1e-12.

`forward(input_ids, past_kv=...)` is an incremental path used only by the
eager references in `reference.py`: new queries attend over `[past; new]`
keys with a lower-right-aligned causal mask, positions continue after the
past. It is never compiled by the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

KV_MODES = ("gqa", "repeat", "repeat_interleave")
MASK_MODES = ("causal", "explicit", "window")
NORMS = ("layer", "rms")
MIXERS = ("none", "cumsum")


@dataclass(frozen=True, kw_only=True)
class PlainConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 48
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    rope_theta: float = 10000.0
    rotary_dim: int = 0
    """Head dims RoPE rotates (the first ones, even); 0: all of them."""
    norm: str = "rms"
    """"layer": nn.LayerNorm; "rms": RMSNorm written by hand."""
    kv_mode: str = "gqa"
    """How K/V heads reach the query heads when num_kv_heads < num_heads:
    "gqa": SDPA(enable_gqa=True); "repeat": expand + reshape before SDPA
    (HF `repeat_kv`); "repeat_interleave": `Tensor.repeat_interleave`."""
    mask: str = "causal"
    """"causal": SDPA(is_causal=True); "explicit": a boolean tril mask;
    "window": a boolean sliding-window mask (the last `window` positions)."""
    window: int = 6
    learned_positions: int = 0
    """Rows of a learned absolute position table added to the token
    embedding (GPT-2 style, besides RoPE); 0: none."""
    dropout: float = 0.0
    """Dropout after the MLP activation (in training mode)."""
    mixer: str = "none"
    """"cumsum": add a `torch.cumsum` over the sequence in every block (an
    operator no architecture pass claims)."""

    def __post_init__(self):
        assert self.kv_mode in KV_MODES, self.kv_mode
        assert self.mask in MASK_MODES, self.mask
        assert self.norm in NORMS, self.norm
        assert self.mixer in MIXERS, self.mixer
        assert self.num_heads % self.num_kv_heads == 0
        assert self.head_dim % 2 == 0
        assert self.rotary_dim % 2 == 0 and self.rotary_dim <= self.head_dim


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # x: [B, L, C]; no dtype change
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(cfg: PlainConfig) -> nn.Module:
    if cfg.norm == "rms":
        return RMSNorm(cfg.hidden_size)
    return nn.LayerNorm(cfg.hidden_size)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_partial_rope(x, positions, cfg):
    """RoPE on the first `cfg.rotary_dim` head dims, the rest passed through."""
    rot = cfg.rotary_dim or x.shape[-1]
    if rot == x.shape[-1]:
        return apply_rope(x, positions, cfg.rope_theta)
    return torch.cat([apply_rope(x[..., :rot], positions, cfg.rope_theta), x[..., rot:]], dim=-1)


def apply_rope(x, positions, theta: float):
    """x: [B, H, L, D], positions: [L] (long) -> x rotated, same dtype."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=x.dtype) / d))
    freqs = positions.to(x.dtype)[:, None] * inv_freq[None, :]  # [L, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [L, D]
    return x * emb.cos() + rotate_half(x) * emb.sin()


class Attention(nn.Module):
    def __init__(self, cfg: PlainConfig):
        super().__init__()
        self.cfg = cfg
        c, h, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(c, h * d, bias=False)
        self.k_proj = nn.Linear(c, hkv * d, bias=False)
        self.v_proj = nn.Linear(c, hkv * d, bias=False)
        self.o_proj = nn.Linear(h * d, c, bias=False)

    def _expand_kv(self, x):
        """x: [B, Hkv, S, D] -> [B, H, S, D] for the "repeat*" modes."""
        n_rep = self.cfg.num_heads // self.cfg.num_kv_heads
        if n_rep == 1 or self.cfg.kv_mode == "gqa":
            return x
        if self.cfg.kv_mode == "repeat_interleave":
            return x.repeat_interleave(n_rep, dim=1)
        b, hkv, s, d = x.shape
        return x[:, :, None, :, :].expand(b, hkv, n_rep, s, d).reshape(b, hkv * n_rep, s, d)

    def forward(self, x, past=None):
        """x: [B, L, C]; past: None or (k, v), each [B, Hkv, S, D] after RoPE.

        Returns (out [B, L, C], (k, v) of the new positions [B, Hkv, L, D]).
        """
        cfg = self.cfg
        b, L, _ = x.shape
        s = 0 if past is None else past[0].shape[2]
        q = self.q_proj(x).view(b, L, cfg.num_heads, cfg.head_dim).transpose(1, 2)  # [B, H, L, D]
        k = self.k_proj(x).view(b, L, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)  # [B, Hkv, L, D]
        v = self.v_proj(x).view(b, L, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        if past is None:
            positions = torch.arange(L, device=x.device)
        else:
            positions = torch.arange(L, device=x.device) + s
        q = apply_partial_rope(q, positions, cfg)
        k = apply_partial_rope(k, positions, cfg)
        new_kv = (k, v)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)  # [B, Hkv, S+L, D]
            v = torch.cat([past[1], v], dim=2)
        k, v = self._expand_kv(k), self._expand_kv(v)
        gqa = {"enable_gqa": True} if cfg.kv_mode == "gqa" and cfg.num_kv_heads != cfg.num_heads else {}
        if past is not None:
            # new queries sit at the end of the keys: lower-right causal alignment
            mask = torch.ones(L, s + L, dtype=torch.bool, device=x.device).tril(diagonal=s)
            if cfg.mask == "window":
                mask = mask & ~torch.ones(L, s + L, dtype=torch.bool, device=x.device).tril(s - cfg.window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
        elif cfg.mask in ("explicit", "window"):
            mask = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
            if cfg.mask == "window":
                mask = mask & ~torch.ones(L, L, dtype=torch.bool, device=x.device).tril(-cfg.window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, **gqa)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        o = o.transpose(1, 2).reshape(b, L, cfg.num_heads * cfg.head_dim)  # [B, L, H*D]
        return self.o_proj(o), new_kv


class CumsumMixer(nn.Module):
    """A running mean over the sequence: mixes positions with an operator
    that no attention pass claims."""

    def forward(self, x):
        # x: [B, L, C]
        n = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[None, :, None]
        return torch.cumsum(x, dim=1) / n


class MLP(nn.Module):
    def __init__(self, cfg: PlainConfig):
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, x):
        return self.down(self.dropout(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, cfg: PlainConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mixer = CumsumMixer() if cfg.mixer == "cumsum" else None
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, past=None):
        a, new_kv = self.attn(self.attn_norm(x), past)
        x = x + a
        if self.mixer is not None:
            x = x + self.mixer(x)
        x = x + self.mlp(self.mlp_norm(x))
        return x, new_kv


class PlainTransformer(nn.Module):
    def __init__(self, cfg: PlainConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.positions = nn.Embedding(cfg.learned_positions, cfg.hidden_size) if cfg.learned_positions else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, past_kv=None):
        """input_ids: [B, L] -> logits [B, L, V].

        With `past_kv` (a list of (k, v) per layer, each [B, Hkv, S, D]) the
        tokens are taken to sit at positions S..S+L-1.
        """
        logits, _ = self.forward_with_kv(input_ids, past_kv)
        return logits

    def forward_with_kv(self, input_ids, past_kv=None):
        """Like forward, also returning the new positions' (k, v) per layer."""
        x = self.embed(input_ids)  # [B, L, C]
        if self.positions is not None:
            start = 0 if past_kv is None else past_kv[0][0].shape[-2]
            x = x + self.positions(torch.arange(start, start + input_ids.shape[1], device=input_ids.device))
        new = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if past_kv is None else past_kv[i])
            new.append(kv)
        return self.lm_head(self.norm(x)), new


def make_plain(seed: int = 0, dtype=torch.float64, **overrides) -> PlainTransformer:
    """A deterministic tiny PlainTransformer.

    Weights are drawn with a larger spread than the PyTorch defaults so that
    attention is far from uniform and every gradient term is visible.
    """
    cfg = PlainConfig(**overrides)
    gen = torch.Generator().manual_seed(seed)
    model = PlainTransformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("_norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name == "embed.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model.to(dtype)
