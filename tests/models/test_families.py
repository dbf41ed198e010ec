"""Every HF family LongStraw claims matches eager; every other one is refused
with a message that names the cause (registry: `families.py`).

Each supported family runs in both modes at one group shape, then again
under `torch.use_deterministic_algorithms(True)` (uninitialised memory is
NaN there, so a state position capture never wrote cannot hide) at another,
always with `verify_state=True`. In CI only the deterministic pass runs:
in both modes for the families the issue names, in one mode (alternating
between families) for the others; the rest runs with `-m slow`, which
also sweeps every family over every shape. Every refused family is refused
with its message, whose advice, followed, compiles and matches eager, or
which says that LongStraw has no fix.
"""

from __future__ import annotations

import pytest
import torch

import longstraw
from longstraw.errors import NO_FIX

from conftest import raises_longstraw
from helpers.families import FAMILIES, GENERATED, REFUSED, SUPPORTED, generated_section
from helpers.harness import assert_parity
from helpers.losses import grpo_loss_f64
from helpers.parity import check_family, deterministic_algorithms
from helpers.tiny_models import make_group

TOL = 1e-6  # HF norms and RoPE round through float32

# (G, P, R, prefix_chunk_size, pad): chunks that divide the prompt and chunks
# that do not, one chunk, one-position chunks, a two-token prompt, G = 1.
SHAPES = [
    (3, 13, 5, 5, True),
    (2, 9, 4, 3, False),
    (4, 17, 3, 32, True),
    (1, 6, 7, 1, True),
    (3, 2, 4, 4, True),
]
CORE = ("qwen3", "llama", "qwen2", "mistral", "gemma3", "phi3", "gpt_neox", "olmo2", "smollm3", "gpt2",
        "deepseek_v3", "qwen3_5", "gpt_bigcode", "qwen3_5_moe", "gpt_oss", "mimo_v2_flash")


def _cases(deterministic: bool) -> list:
    cases = []
    for i, family in enumerate(SUPPORTED):
        shape = SHAPES[(i + deterministic) % len(SHAPES)]
        for j, mode in enumerate(("exact", "detached")):
            # CI: the families in both modes, the others in one (alternating), of the deterministic
            # pass only (the plain pass adds a shape; the dense and hybrid models run it in other files)
            in_ci = deterministic and (family.name in CORE or (i + j) % 2 == 0)
            marks = [] if in_ci else [pytest.mark.slow]
            cases.append(pytest.param(family.name, mode, shape, id=f"{family.name}-{mode}", marks=marks))
    return cases


@pytest.mark.parametrize("name,mode,shape", _cases(deterministic=False))
def test_family_matches_eager(name, mode, shape):
    check_family(name, mode, shape, deterministic=False)


@pytest.mark.parametrize("name,mode,shape", _cases(deterministic=True))
def test_family_matches_eager_with_nan_filled_memory(name, mode, shape):
    check_family(name, mode, shape, deterministic=True)


ROWS_IN_CI = {"qwen3_5": "exact", "gpt_oss": "detached", "qwen3_5_moe": "exact", "gemma3": "detached",
              "deepseek_v3": "exact", "glm_moe_dsa": "detached"}


def _rows_cases() -> list:
    return [pytest.param(f.name, mode, id=f"{f.name}-{mode}",
                         marks=[] if ROWS_IN_CI.get(f.name) == mode else [pytest.mark.slow])
            for f in SUPPORTED for mode in ("exact", "detached")]


@pytest.mark.parametrize("name,mode", _rows_cases())
def test_family_matches_eager_in_steps_of_several_rows(name, mode):
    """`branch_rows=3` over a group of 4 (a step of three rows, then one):
    eager's gradients, NaN-filled memory (every built-in pass runs rows;
    `tests/runtime/test_branch_rows.py` checks which steps held several)."""
    check_family(name, mode, (4, 13, 5, 5, True), deterministic=True, branch_rows=3)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "G{}-P{}-R{}-chunk{}{}".format(*s[:4], "-pad" * s[4]))
@pytest.mark.parametrize("mode", ["exact", "detached"])
@pytest.mark.parametrize("name", [f.name for f in SUPPORTED])
def test_family_shape_sweep(name, mode, shape):
    check_family(name, mode, shape, deterministic=True)


# Families whose TRL layout (a left-padded prompt) does not run, whatever the cut: the reason each has.
TRL_LAYOUT = {
    "glm_moe_dsa": "its attn_mask selects keys with a top-k",  # DSA's proof reads positions only, not a key mask
    "llama4_text": "the attn_mask depends on inputs",  # chunked attention and'd with the key padding mask
}
NAN_IN_EAGER = {"gemma3n"}  # HF's own gradients are NaN with a left-padded prompt (eager, no LongStraw involved)


@pytest.mark.slow
@pytest.mark.parametrize("name", [f.name for f in SUPPORTED if f.name not in NAN_IN_EAGER])
def test_the_scorer_cuts_every_familys_branch_steps(name):
    """The integrations' scorer at TRL's layout (two prompts, one
    left-padded, ragged completions), exact mode, NaN-filled memory:
    every family's branch steps stop at their rows' last read position
    (23 of 36 positions) with eager's loss and gradients, or the family is
    refused at this layout for a reason of its own."""
    from helpers.padding import padded_group, scored_grpo_loss

    family = FAMILIES[name]
    groups = [padded_group(3, 7, 5, 1, [5, 2, 3], seed=1), padded_group(3, 7, 5, 0, [1, 4, 2], seed=2)]
    batch = tuple(torch.cat(parts) for parts in zip(*groups))
    backend = longstraw.Backend(prompt_grad="exact", verify_state=True)
    with family.bind(), deterministic_algorithms(True):
        if name in TRL_LAYOUT:
            with raises_longstraw(TRL_LAYOUT[name]):
                assert_parity(scored_grpo_loss, backend, None, family.build(), *batch, 0.7, tol=2e-5)
            return
        assert_parity(scored_grpo_loss, backend, None, family.build(), *batch, 0.7, tol=max(family.tol, 2e-5))
    runner = backend.plans[-1].runner
    assert runner.program.read_masks is not None, runner.program.uncut
    assert runner.last_call.branch_positions == (23, 36)


@pytest.mark.parametrize("name", [f.name for f in REFUSED])
def test_refused_family_names_the_cause(name):
    family = FAMILIES[name]
    model = family.build()
    group = make_group(2, 7, 3)
    compiled = torch.compile(grpo_loss_f64, backend=longstraw.Backend(prefix_chunk_size=4))
    with family.bind(), raises_longstraw(family.refused):
        compiled(model, *group)


def _refusal_cases() -> list:
    """Every refused family; in CI the first of each kind of advice (its
    `Fix`) and of each refusal without one (its message), the rest with
    `-m slow`."""
    seen: set = set()
    cases = []
    for family in REFUSED:
        kind = family.fix or family.refused
        cases.append(pytest.param(family.name, marks=[pytest.mark.slow] if kind in seen else []))
        seen.add(kind)
    return cases


@pytest.mark.parametrize("name", _refusal_cases())
def test_refusal_advice_works(name):
    """The refusal's advice, done as its message says (`Family.fix`), makes
    the model compile and match eager in float64; a refusal without advice
    says so."""
    family = FAMILIES[name]
    model = family.build()
    group = make_group(2, 7, 3)
    if family.fix is None:
        compiled = torch.compile(grpo_loss_f64, backend=longstraw.Backend(prefix_chunk_size=4))
        with family.bind(), raises_longstraw(family.refused) as info:
            compiled(model, *group)
        assert NO_FIX in str(info.value)
        return
    family.fix.model(model)
    loss = family.fix.loss or grpo_loss_f64
    backend = longstraw.Backend(prefix_chunk_size=4, verify_state=True)
    with family.fix.bind():
        assert_parity(loss, backend, None, model, *group, tol=TOL, what=f"{name} loss, advice followed")
    assert backend.plans, "the compiled loss ran without a LongStraw plan"


def test_deterministic_mode_fills_uninitialised_memory_with_nan():
    """The premise of the second pass."""
    with deterministic_algorithms(True):
        assert torch.empty(16, dtype=torch.float64).isnan().all()


def test_every_family_is_claimed_once():
    names = [f.name for f in SUPPORTED + REFUSED]
    assert len(names) == len(set(names))
    assert set(CORE) <= {f.name for f in SUPPORTED}


@pytest.mark.parametrize("path", sorted(GENERATED), ids=lambda p: p.name)
def test_family_tables_are_generated_from_the_registry(path):
    assert generated_section(path.read_text()) == GENERATED[path](), "run `python tests/helpers/families.py`"


def test_gpt2_with_one_response():
    """Conv1D flattens `[G, T, C]` to `[G * T, C]`; at G = 1 the group axis
    is a size-1 factor of that product and must survive the view back."""
    check_family("gpt2", "exact", (1, 6, 7, 1, True), deterministic=True)
