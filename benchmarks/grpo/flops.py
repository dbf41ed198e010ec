"""FLOPs of a step per mode, for MFU against the measured H200 ceiling."""

from __future__ import annotations

import dataclasses
import math

PEAK_FLOPS = 790e12


LAST_LAYER_STATE_PARAMS = {
    "full_attention": ("k_proj", "v_proj"),
    "linear_attention": ("in_proj_qkv", "in_proj_a", "in_proj_b"),
}
GLM5_STATE_WEIGHTS = ("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_b_proj.weight", "self_attn.indexer.wk.weight")


@dataclasses.dataclass
class FlopModel:
    """Forward FLOPs per token and per (query, key) pair, from the config.

    Only the last R+1 logits are read, so at prompt positions the last
    layer's output is dead: the prompt needs only its state (`prompt`).
    LongStraw's capture computes exactly that; eager computes more, and MFU
    counts the useful work of every mode alike.

    GLM-5 (`of_glm5`): MLA counted as the model defines it (keys and values
    decompressed by `kv_b_proj` per token, attention over the nope + rope
    query/key and the value heads); LongStraw's absorbed form does more per
    pair and is not credited. DSA's attention counts the `selected_keys`
    (index_topk) a query reads, though eager and LongStraw both compute
    every visible key under the selection mask. The indexer scores every
    visible pair (float32, counted against the bf16 peak) under no_grad:
    forward only, in every mode."""

    linear_per_token: float  # all linears but the LM head, per token (routed experts: the chosen ones)
    head_per_token: float
    attention_per_pair: float  # summed over full-attention layers
    recurrent_per_token: float  # Gated DeltaNet state update and readout
    dead_per_token: float = 0.0  # last layer's work at a prompt position beyond its state
    dead_per_pair: float = 0.0
    selected_keys: float = math.inf  # keys a query attends to at most (DSA's index_topk)
    index_per_pair: float = 0.0  # DSA indexer scores, per visible (query, key), no backward
    dead_index_per_pair: float = 0.0

    @classmethod
    def of(cls, model) -> FlopModel:
        cfg = model.config
        if cfg.model_type == "glm_moe_dsa":
            return cls.of_glm5(model)
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

    @classmethod
    def of_glm5(cls, model) -> FlopModel:
        """Every 2-D weight once per token (the router's over all experts),
        the routed experts' stacked weights for the `num_experts_per_tok`
        chosen ones; the last layer's prompt state is its latent and rope key
        (`kv_a_proj_with_mqa`), their decompression (`kv_b_proj`) and the index key (`wk`)."""
        cfg = model.config
        layers = model.model.layers

        def layer_linear(layer) -> float:
            dense = sum(p.numel() for p in layer.parameters() if p.dim() == 2)
            experts = getattr(layer.mlp, "experts", None)
            routed = 0 if experts is None else cfg.num_experts_per_tok * sum(p[0].numel() for p in experts.parameters())
            return dense + routed

        pair = 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        index_pair = 2 * cfg.index_n_heads * cfg.index_head_dim + 2 * cfg.index_n_heads  # q.k per head, then the weighted sum
        full_indexers = sum(t == "full" for t in cfg.indexer_types)
        kept = sum(p.numel() for n, p in layers[-1].named_parameters() if n.endswith(GLM5_STATE_WEIGHTS))
        return cls(2 * sum(layer_linear(layer) for layer in layers), 2 * model.get_output_embeddings().weight.numel(),
                   len(layers) * pair, 0.0, dead_per_token=2 * (layer_linear(layers[-1]) - kept), dead_per_pair=pair,
                   selected_keys=cfg.index_topk, index_per_pair=full_indexers * index_pair,
                   dead_index_per_pair=index_pair if cfg.indexer_types[-1] == "full" else 0.0)

    def forward(self, tokens: int, pairs: float, head_tokens: int) -> float:
        return (self.linear_per_token + self.recurrent_per_token) * tokens + self.attention_per_pair * pairs + self.head_per_token * head_tokens

    def attended(self, first: int, count: int, keys: float = math.inf) -> float:
        """(query, key) pairs of the queries at positions [first, first + count),
        a query at position q reading min(q + 1, keys) keys."""

        def upto(n: int) -> float:
            return n * (n + 1) / 2 if n <= keys else keys * (keys + 1) / 2 + (n - keys) * keys

        return upto(first + count) - upto(first)

    def prompt(self, P: int) -> float:
        pairs = self.attended(0, P, self.selected_keys)
        return self.forward(P, pairs, 0) - self.dead_per_token * P - self.dead_per_pair * pairs

    def branches(self, G: int, P: int, R: int) -> float:
        return G * self.forward(R, self.attended(P, R, self.selected_keys), R)

    def index(self, G: int, P: int, R: int) -> float:
        """The indexer's scoring (no backward) of the prompt once and the G branches."""
        prompt = (self.index_per_pair - self.dead_index_per_pair) * self.attended(0, P)
        return prompt + G * self.index_per_pair * self.attended(P, R)

    def compiled_forward(self, G: int, P: int, R: int) -> float:
        """The compiled loss's forward: prompt capture plus the G branch forwards."""
        return self.prompt(P) + self.branches(G, P, R) + self.index(G, P, R)

    def step(self, mode: str, G: int, P: int, R: int) -> float:
        if mode in ("eager", "eager_ckpt"):  # the prompt G times, its indexer too
            return 3 * (G * self.prompt(P) + self.branches(G, P, R)) + self.index(G, P, R) + (G - 1) * self.index(0, P, 0)
        if mode == "longstraw_detached":
            return self.prompt(P) + 3 * self.branches(G, P, R) + self.index(G, P, R)
        return 3 * (self.prompt(P) + self.branches(G, P, R)) + self.index(G, P, R)
