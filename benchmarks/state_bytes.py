"""State bytes per prompt position at the real GLM-5.1 and DeepSeek-V3 shapes,
next to what capturing decompressed K/V would cost.

Each model is built on the meta device from its full config (every layer,
every routed expert, no weights) and planned by `longstraw.explain` on a
small group, so the sizes are the buffers the runtime would allocate, not a
formula. GLM-5.1 has GLM-5's architecture and shapes (NVIDIA's Megatron
Bridge maps both with one bridge), which are transformers' `GlmMoeDsaConfig`
defaults; DeepSeek-V3's are `DeepseekV3Config`'s. Decompressed K/V is what
the general attention pass would capture: per head the key (nope + rope)
and the value, in bf16.

    python benchmarks/state_bytes.py --out benchmarks/results/state_bytes.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

import longstraw  # noqa: E402
from grpo.models import grpo_loss, make_group  # noqa: E402
from grpo.results import provenance  # noqa: E402

MODELS = {
    "GLM-5.1": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM),
    "DeepSeek-V3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
}
# the traced group: two prompt chunks, so the traced DSA top-k is GLM's 2048 (it is min(2048, positions))
G, CHUNK, R = 2, 2048, 8
P = 2 * CHUNK
DTYPE_BYTES = 2  # bf16


def build(name: str) -> transformers.PreTrainedModel:
    """The full model on the meta device, in bf16, as `explain` traces it."""
    make_config, cls = MODELS[name]
    with torch.device("meta"):
        model = cls(make_config()).to(torch.bfloat16)
    model.config.use_cache = False  # HF's cache makes real meta tensors, which Dynamo cannot trace
    model.set_attn_implementation("sdpa")
    model.set_experts_implementation("grouped_mm")  # batched_mm gathers an expert's weights per routed token
    return model


def state_by_layer(name: str) -> tuple[transformers.PretrainedConfig, dict[str, list[int]]]:
    """The model's config and, per attention module, the bytes per position of
    each state tensor `explain` plans (latent, rope key[, index key])."""
    model = build(name)
    group = make_group(G, P, R, model.config.vocab_size, torch.device("meta"))
    report = longstraw.explain(grpo_loss, model, group.input_ids, group.advantages, group.mask, R,
                               options={"prefix_chunk_size": CHUNK})
    layers: dict[str, list[int]] = collections.defaultdict(list)
    for tensor in report.state:
        layers[tensor.layer].append(tensor.bytes_per_position)
    assert report.state_fixed_bytes == 0
    return model.config, dict(layers)


def decompressed_bytes(config: transformers.PretrainedConfig) -> int:
    """K and V of one layer and position as HF computes them: heads x (nope + rope + value)."""
    per_head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    return config.num_attention_heads * per_head * DTYPE_BYTES


def measure(name: str) -> dict:
    config, layers = state_by_layer(name)
    (tensors,) = {tuple(t) for t in layers.values()}  # the same in every layer
    state, count = sum(tensors), config.num_hidden_layers
    assert len(layers) == count
    decompressed = decompressed_bytes(config)
    return {
        "model": name, "layers": count, "state_tensors_bytes_per_position_per_layer": list(tensors),
        "state_bytes_per_position_per_layer": state, "state_bytes_per_position": state * count,
        "decompressed_kv_bytes_per_position_per_layer": decompressed,
        "decompressed_kv_bytes_per_position": decompressed * count, "ratio": decompressed / state,
        "config": {k: getattr(config, k, None) for k in (
            "hidden_size", "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
            "index_head_dim", "index_n_heads", "index_topk", "n_routed_experts", "vocab_size")},
    }


def table(rows: list[dict]) -> str:
    lines = [f"{'model':12} {'layers':>6} {'state B/pos/layer':>17} {'state B/pos':>11} "
             f"{'K/V B/pos/layer':>15} {'K/V B/pos':>11} {'ratio':>6}"]
    for r in rows:
        lines.append(f"{r['model']:12} {r['layers']:6d} {r['state_bytes_per_position_per_layer']:17,d} "
                     f"{r['state_bytes_per_position']:11,d} {r['decompressed_kv_bytes_per_position_per_layer']:15,d} "
                     f"{r['decompressed_kv_bytes_per_position']:11,d} {r['ratio']:6.1f}")
    lines.append("state: what LongStraw captures (latent, rope key, GLM's index key); "
                 "K/V: decompressed, as HF computes them")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = [measure(name) for name in MODELS]
    result = {
        **provenance(f"python benchmarks/state_bytes.py --out benchmarks/results/{Path(args.out).name}"),
        "transformers": transformers.__version__,
        "traced": {"G": G, "P": P, "R": R, "prefix_chunk_size": CHUNK, "dtype": "bfloat16", "device": "meta"},
        "models": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
