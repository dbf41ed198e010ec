"""Model bindings (`longstraw.models`): with longstraw imported, Dynamo
traces LongStraw's operators in place of HF Qwen3.5's Gated DeltaNet
functions, so the model compiles with nothing bound, whatever the import
order; eager calls keep HF's functions."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import longstraw
from longstraw.models import qwen3_5

from helpers.compare import assert_close, assert_grads_close
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64
from helpers.reference import eager_loss_and_grads, hybrid_detached_reference
from helpers.tiny_models import make_group, make_qwen3_5

TOL = 1e-6


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_compiles_without_bind(mode):
    """HF's module functions are HF's own (nothing bound), yet the compiled
    loss runs LongStraw's operators: parity with the bound eager model."""
    model = make_qwen3_5()
    group = make_group(3, 30, 9, pad=True)
    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    assert module.torch_chunk_gated_delta_rule is not qwen3_5.chunk_gated_delta_rule  # not bound
    got_loss, got = compiled_loss_and_grads(
        compile_loss(grpo_loss_f64, longstraw.Backend(prompt_grad=mode, prefix_chunk_size=8)), model, *group
    )
    with qwen3_5.bound():
        want_loss, want = (eager_loss_and_grads(grpo_loss_f64, model, *group) if mode == "exact"
                           else hybrid_detached_reference(model, *group))
    assert_close(got_loss, want_loss, TOL)
    assert_grads_close(got, want, TOL)


_IMPORT_ORDER = """
import sys, torch
{first}
{second}
from longstraw.models import qwen3_5
model = transformers.Qwen3_5ForCausalLM(qwen3_5.tiny_config()).double()
ids = torch.randint(0, 64, (1, 12))
graphs = []
def backend(gm, example_inputs):
    graphs.append(gm)
    return gm
torch.compile(lambda m, x: m(input_ids=x).logits.sum(), backend=backend)(model, ids)
targets = {{str(n.target) for g in graphs for n in g.graph.nodes}}
assert "longstraw.gated_delta_rule.default" in targets and "longstraw.causal_conv1d.default" in targets, targets
print("substituted")
"""


@pytest.mark.parametrize("longstraw_first", [True, False], ids=["longstraw-first", "transformers-model-first"])
def test_substitution_whatever_the_import_order(longstraw_first):
    """Imported before or after HF's modeling module (an import hook covers
    the later one), longstraw's operators appear in any backend's graph."""
    import_longstraw = "import longstraw"
    import_model = "import transformers, transformers.models.qwen3_5.modeling_qwen3_5"
    first, second = (import_longstraw, import_model) if longstraw_first else (import_model, import_longstraw)
    script = _IMPORT_ORDER.format(first=first, second=second)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent)
    assert proc.returncode == 0 and "substituted" in proc.stdout, proc.stdout + proc.stderr
