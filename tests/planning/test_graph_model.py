"""The partitioned graph for people (`planning/graph_model.py`), on a hand-built partition: each node's
region, operator, layer, value and source line; each state slot a node with its size and reason,
fed by what it captures and feeding the operators that read it; and a slot described by its reader."""

from __future__ import annotations

import operator
import types

import torch
import torch.fx as fx

from longstraw.analysis.slots import SlotKind, StateSlot
from longstraw.planning.graph_model import COLORS, REGION_TITLES, REGIONS, CapturedTensor, describe_slot, graph_model

TRACE = 'File "/src/model.py", line 12, in forward\n    k = self.k_proj(x)\n'


def _node(graph: fx.Graph, op: str, target, args: tuple, value: torch.Tensor | None = None,
          module: str | None = None) -> fx.Node:
    node = graph.create_node(op, target, args)
    node.meta["longstraw_value"] = value
    if module is not None:
        node.meta["nn_module_stack"] = {"m": (module, torch.nn.Module)}
        node.meta["stack_trace"] = TRACE
    return node


def _plan() -> tuple[types.SimpleNamespace, dict[str, fx.Node]]:
    """ids, w -> mask (outer) -> k (prefix, captured by slot 0) -> a positional
    block -> attention (branch, reads slot 0) -> a conv (branch, its carry slot
    1) -> the loss (tail); slot 2 captures the block and no operator reads it."""
    graph = fx.Graph()
    ids = _node(graph, "placeholder", "ids", (), torch.zeros(1, 7, dtype=torch.long))
    w = _node(graph, "placeholder", "w", (), torch.zeros(4, 4))
    mask = _node(graph, "call_function", torch.ones_like, (ids,), torch.ones(1, 7, dtype=torch.long))
    k = _node(graph, "call_method", "view", (w, -1), torch.zeros(16), "L['model'].layers[3].self_attn.k_proj")
    block = _node(graph, "call_function", operator.mul, (k, mask), torch.zeros(7, 16))
    attn = _node(graph, "call_function", torch.sin, (block,), torch.zeros(7, 16), "L['model'].layers[3].self_attn")
    conv = _node(graph, "call_function", torch.cos, (attn,), torch.zeros(7, 16, dtype=torch.float64),
                 "L['model'].layers[4].conv")
    loss = _node(graph, "call_function", torch.sum, (conv,), torch.zeros((), dtype=torch.float64), "L['model'].lm_head")
    out = _node(graph, "output", "output", (loss,))
    slots = [
        StateSlot(0, SlotKind.SEQUENCE, k, 2, 0, (1, 2, 7, 4), torch.float32, "causal_attention:attn"),
        StateSlot(1, SlotKind.CARRY, conv, None, 0, (1, 3, 5), torch.float64, "causal_conv:conv"),
        StateSlot(2, SlotKind.SEQUENCE, block, 0, None, (7, 3), torch.bfloat16, "my_pass:block"),
    ]
    part = types.SimpleNamespace(
        graph=graph, slots=slots, sequence={k}, positional={block}, branch={attn, conv}, tail={loss},
        claims={attn: types.SimpleNamespace(name="causal_attention"), conv: types.SimpleNamespace(name="causal_conv")},
        sites={attn: [types.SimpleNamespace(slot=0)], conv: [types.SimpleNamespace(slot=1)]},
    )
    return part, dict(ids=ids, w=w, mask=mask, k=k, block=block, attn=attn, conv=conv, loss=loss, out=out)


def test_every_node_has_its_region():
    part, nodes = _plan()
    g = graph_model(types.SimpleNamespace(partition=part))
    regions = {name: g.nodes[node.name]["region"] for name, node in nodes.items()}
    assert regions == dict(ids="input", w="input", mask="outer", k="prefix", block="prefix", attn="branch",
                           conv="branch", loss="tail", out="tail")
    assert {g.nodes[f"state[{i}]"]["region"] for i in range(3)} == {"state"}
    assert set(regions.values()) | {"state"} == set(REGIONS) == set(REGION_TITLES) == set(COLORS)


def test_a_node_carries_its_operator_layer_value_source_and_claim():
    part, nodes = _plan()
    g = graph_model(types.SimpleNamespace(partition=part))
    assert g.nodes[nodes["k"].name] == dict(region="prefix", op="view", layer="model.layers.3", shape=[16],
                                            dtype="float32", source="/src/model.py:12 (forward)", detail="")
    assert g.nodes[nodes["attn"].name]["detail"] == "claimed by causal_attention"
    assert g.nodes[nodes["loss"].name]["layer"] == "model.lm_head"  # no numbered component: the whole path
    assert g.nodes[nodes["ids"].name] == dict(region="input", op="placeholder", layer=None, shape=[1, 7],
                                              dtype="int64", source=None, detail="")
    assert g.nodes[nodes["out"].name]["shape"] is None and g.nodes[nodes["out"].name]["dtype"] is None


def test_the_edges_are_the_graphs_and_the_states():
    part, nodes = _plan()
    g = graph_model(types.SimpleNamespace(partition=part))
    plain = {(a, b) for a, b, d in g.edges(data=True) if not d.get("state")}
    assert plain == {(src.name, node.name) for node in part.graph.nodes for src in node.all_input_nodes}
    state = {(a, b) for a, b, d in g.edges(data=True) if d.get("state")}
    k, attn, conv, block = (nodes[n].name for n in ("k", "attn", "conv", "block"))
    assert state == {(k, "state[0]"), ("state[0]", attn), (conv, "state[1]"), ("state[1]", conv), (block, "state[2]")}


def test_a_state_node_tells_its_size_and_reason():
    part, _ = _plan()
    g = graph_model(types.SimpleNamespace(partition=part))
    sequence, carry = g.nodes["state[0]"], g.nodes["state[1]"]
    assert sequence == dict(region="state", op="sequence state", layer="model.layers.3", shape=[1, 2, 7, 4],
                            dtype="float32", source="/src/model.py:12 (forward)",
                            detail="32 B/position; for causal_attention:attn")  # 1 * 2 * 4 float32 per position
    assert carry["op"] == "carry state" and carry["detail"] == "120 B fixed; for causal_conv:conv"  # 15 float64
    assert g.nodes["state[2]"]["detail"] == "6 B/position; for my_pass:block"  # 3 bfloat16 per position


def test_a_slot_is_described_by_the_operator_that_reads_it_else_by_what_it_captures():
    part, nodes = _plan()
    assert describe_slot(part, part.slots[0]) == CapturedTensor(
        index=0, name=nodes["k"].name, kind="sequence", layer="model.layers.3.self_attn", operator="sin",
        source="/src/model.py:12 (forward)", dtype=torch.float32, shape=(1, 2, 7, 4), bytes_per_position=32,
        fixed_bytes=0, reason="causal_attention:attn")
    carry = describe_slot(part, part.slots[1])
    assert (carry.kind, carry.layer, carry.operator, carry.bytes_per_position, carry.fixed_bytes) == (
        "carry", "model.layers.4.conv", "cos", 0, 120)
    unread = describe_slot(part, part.slots[2])
    assert (unread.name, unread.operator, unread.layer) == (nodes["block"].name, "mul", None)
