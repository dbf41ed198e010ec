"""A `StateSlot`'s size (`analysis/slots.py`): a sequence slot costs its
bytes per position, a carry its fixed bytes, and messages name the slot
and its layer."""

from __future__ import annotations

import torch
import torch.fx as fx

from longstraw.analysis.slots import SlotKind, StateSlot


def _node() -> fx.Node:
    graph = fx.Graph()
    node = graph.placeholder("k_proj")
    node.meta["nn_module_stack"] = {"L__model_layers_1_self_attn": ("model.layers.1.self_attn", object)}
    return node


def test_a_sequence_slot_costs_per_position_and_a_carry_a_fixed_size():
    keys = StateSlot(0, SlotKind.SEQUENCE, _node(), token_dim=2, batch_dim=0, shape=(1, 8, 4096, 128),
                     dtype=torch.bfloat16, reason="causal_attention")
    assert keys.bytes_per_position() == 8 * 128 * 2 and keys.fixed_bytes() == 0
    carry = StateSlot(1, SlotKind.CARRY, _node(), token_dim=None, batch_dim=0, shape=(1, 16, 128, 128),
                      dtype=torch.float32, reason="gated_delta_rule")
    assert carry.bytes_per_position() == 0 and carry.fixed_bytes() == 16 * 128 * 128 * 4


def test_a_slot_is_named_with_its_layer():
    slot = StateSlot(3, SlotKind.SEQUENCE, _node(), 2, 0, (1, 8, 16, 64), torch.float32, "causal_attention")
    assert slot.label() == "state slot 3 (causal_attention) of `model.layers.1.self_attn`"
    bare = fx.Graph().placeholder("v_proj")  # traced outside any module: its node's name
    assert StateSlot(4, SlotKind.CARRY, bare, None, 0, (1, 4), torch.float32, "conv1d").label() == (
        "state slot 4 (conv1d) of `v_proj`")
