"""FLOPs of a step per mode, for MFU against the measured H200 ceiling."""

from __future__ import annotations

import dataclasses

PEAK_FLOPS = 790e12


LAST_LAYER_STATE_PARAMS = {
    "full_attention": ("k_proj", "v_proj"),
    "linear_attention": ("in_proj_qkv", "in_proj_a", "in_proj_b"),
}


@dataclasses.dataclass
class FlopModel:
    """Forward FLOPs per token and per (query, key) pair, from the config.

    Only the last R+1 logits are read, so at prompt positions the last
    layer's output is dead: the prompt needs only its state (`prompt`).
    LongStraw's capture computes exactly that; eager computes more, and MFU
    counts the useful work of every mode alike."""

    linear_per_token: float  # all linears but the LM head, per token
    head_per_token: float
    attention_per_pair: float  # summed over full-attention layers
    recurrent_per_token: float  # Gated DeltaNet state update and readout
    dead_per_token: float = 0.0  # last layer's work at a prompt position beyond its state
    dead_per_pair: float = 0.0

    @classmethod
    def of(cls, model) -> FlopModel:
        cfg = model.config
        head = model.get_output_embeddings().weight.numel()
        embed = model.get_input_embeddings().weight.numel()
        linear = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2) - head - (0 if cfg.tie_word_embeddings else embed)
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        pair = 4 * cfg.num_attention_heads * cfg.head_dim
        recurrent = 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim if "linear_attention" in types else 0
        full = sum(t == "full_attention" for t in types)
        kept = LAST_LAYER_STATE_PARAMS[types[-1]]
        dead_linear = sum(p.numel() for n, p in model.model.layers[-1].named_parameters()
                          if p.dim() == 2 and not any(k in n for k in kept))
        last_full = types[-1] == "full_attention"
        # a last linear-attention layer still updates its state (half of `recurrent`); its readout is dead
        return cls(2 * linear, 2 * head, full * pair, (len(types) - full) * recurrent,
                   dead_per_token=2 * dead_linear + (0 if last_full else recurrent / 2), dead_per_pair=pair if last_full else 0)

    def forward(self, tokens: int, pairs: float, head_tokens: int) -> float:
        return (self.linear_per_token + self.recurrent_per_token) * tokens + self.attention_per_pair * pairs + self.head_per_token * head_tokens

    def prompt(self, P: int) -> float:
        pairs = P * (P + 1) / 2
        return self.forward(P, pairs, 0) - self.dead_per_token * P - self.dead_per_pair * pairs

    def branches(self, G: int, P: int, R: int) -> float:
        return self.forward(G * R, G * (R * P + R * (R + 1) / 2), G * R)

    def compiled_forward(self, G: int, P: int, R: int) -> float:
        """The compiled loss's forward: prompt capture plus the G branch forwards."""
        return self.prompt(P) + self.branches(G, P, R)

    def step(self, mode: str, G: int, P: int, R: int) -> float:
        if mode in ("eager", "eager_ckpt"):
            return 3 * (G * self.prompt(P) + self.branches(G, P, R))
        if mode == "longstraw_detached":
            return self.prompt(P) + 3 * self.branches(G, P, R)
        return 3 * (self.prompt(P) + self.branches(G, P, R))
