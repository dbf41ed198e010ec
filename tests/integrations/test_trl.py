"""TRL's `GRPOTrainer` through `longstraw.integrations.trl`.

Parity: one micro-batch of two prompts (one left-padded) with four
right-padded completions each, rows interleaved as TRL's shuffle could leave
them, fed to `compute_loss` of TRL's own `GRPOTrainer` and of
`LongStrawGRPOTrainer`, each built on the same float32 model (same seed);
every parameter's `.grad` must agree. TRL computes the LM head and its
log-softmax in float32 tiles (`trl.kernels`), the scorer one float32
`log_softmax` over HF's logits: the same values rounded in another order,
so the tolerance is 1e-5 of each gradient's largest entry (float32 rounding
is ~1e-7 per operation; a missing or wrong gradient term is of order one).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset
from peft import LoraConfig

from longstraw.errors import InputError, LongStrawError
from longstraw.integrations.trl import LongStrawGRPOTrainer, shuffle_groups

from helpers.paths import REPO

EXAMPLE = REPO / "examples" / "trl_grpo.py"
G, P, R = 4, 6, 5
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trl_grpo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def make(example: ModuleType, tmp_path: pathlib.Path, trainer_cls: type, config: dict | None = None, **kwargs):
    """A trainer on the example's tiny model (seeded: every call, the same
    weights), without a reference model (beta=0)."""
    tokenizer = example.tiny_tokenizer()
    args = example.grpo_config(str(tmp_path), **{"beta": 0.0, **(config or {})})
    return trainer_cls(
        model=example.tiny_model(tokenizer),
        reward_funcs=example.yes_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": example.PROMPTS}),
        processing_class=tokenizer,
        **kwargs,
    )


def micro_batch(vocab: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Two prompts (the second left-padded by 2), four completions each, some
    right-padded, rows interleaved; old log-probs off-policy so that the
    ratio and its clipping both matter."""
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, vocab, (2, P), generator=gen)  # [2, P]
    prompt_mask = torch.ones(2, P, dtype=torch.long)
    prompts[1, :2], prompt_mask[1, :2] = pad_id, 0
    order = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1])  # [2G]: the prompt of each row
    lengths = torch.tensor([5, 3, 5, 1, 4, 5, 2, 5])  # [2G]
    completion_mask = (torch.arange(R)[None] < lengths[:, None]).long()  # [2G, R]
    completions = torch.randint(3, vocab, (2 * G, R), generator=gen).masked_fill(completion_mask == 0, pad_id)
    return {
        "prompt_ids": prompts[order],
        "prompt_mask": prompt_mask[order],
        "completion_ids": completions,
        "completion_mask": completion_mask,
        "advantages": torch.randn(2 * G, generator=gen),
        "old_per_token_logps": -3.0 + 0.3 * torch.randn(2 * G, R, generator=gen),
        "num_items_in_batch": completion_mask.sum(),
    }


def grads_of(trainer, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`.grad` of every parameter after one `compute_loss(...).backward()`,
    as the first micro-batch of `Trainer.train` would run it."""
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    trainer.compute_loss(trainer.model, inputs).backward()
    return {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.requires_grad}


def assert_grads_match(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, grad in want.items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(got[name], grad, rtol=0, atol=REL_TOL * scale, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("loss_type, lora", [("dapo", False), ("grpo", False), ("dapo", True)])
def test_exact_gradients_equal_trl(example, tmp_path, loss_type, lora):
    """With `lora`, a PEFT LoRA adapter (randomly initialised on both sides,
    so every adapter weight has a gradient) is what trains."""
    config = {"loss_type": loss_type}
    extra = {"peft_config": LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)} if lora else {}
    ours = make(example, tmp_path, LongStrawGRPOTrainer, config, longstraw_options={"verify_state": True}, **extra)
    theirs = make(example, tmp_path, trl.GRPOTrainer, config, **extra)
    tokenizer = ours.processing_class
    inputs = micro_batch(len(tokenizer), tokenizer.pad_token_id)
    assert_grads_match(grads_of(ours, inputs), grads_of(theirs, inputs))
    assert len(ours.longstraw_backend.plans) == 1


def test_scoring_under_no_grad_equals_trl(example, tmp_path):
    """The old policy's and the reference's scoring path (values only), at
    two completion lengths: the second re-plans (Dynamo may trace it with
    dynamic sizes, which LongStraw specialises)."""
    ours = make(example, tmp_path, LongStrawGRPOTrainer)
    theirs = make(example, tmp_path, trl.GRPOTrainer)
    inputs = micro_batch(len(ours.processing_class), ours.processing_class.pad_token_id)
    for keep in (R, R - 2):
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"][:, :keep]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"][:, :keep]], dim=1)
        with torch.no_grad():
            got = ours._get_per_token_logps_and_entropies(ours.model, input_ids, mask, keep, 2, compute_entropy=True)
            want = theirs._get_per_token_logps_and_entropies(theirs.model, input_ids, mask, keep, 2, compute_entropy=True)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert len(ours.longstraw_backend.plans) == 2


def test_new_lengths_do_not_trace_the_scorer_again(example, tmp_path):
    """A training loop's micro-batches bring new prompt and completion
    lengths: Dynamo traces the scorer once, with dynamic sizes, and every
    length matches TRL."""
    ours = make(example, tmp_path, LongStrawGRPOTrainer)
    theirs = make(example, tmp_path, trl.GRPOTrainer)
    inputs = micro_batch(len(ours.processing_class), ours.processing_class.pad_token_id)
    torch._dynamo.utils.counters.clear()
    for cut, keep in ((0, R), (1, R - 1), (2, R), (0, R - 2)):
        input_ids = torch.cat([inputs["prompt_ids"][:, cut:], inputs["completion_ids"][:, :keep]], dim=1)
        mask = torch.cat([inputs["prompt_mask"][:, cut:], inputs["completion_mask"][:, :keep]], dim=1)
        with torch.no_grad():
            got = ours._get_per_token_logps_and_entropies(ours.model, input_ids, mask, keep, 2)
            want = theirs._get_per_token_logps_and_entropies(theirs.model, input_ids, mask, keep, 2)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert len(ours.longstraw_backend.plans) == 4


def test_detached_runs(example, tmp_path):
    """Detached mode drops the prompt-state term of the gradient by design:
    it must run and give finite gradients, and differ from TRL's by far more
    than the parity tolerance (so that tolerance would catch a lost term)."""
    detached = make(example, tmp_path, LongStrawGRPOTrainer, longstraw_options={"prompt_grad": "detached"})
    theirs = make(example, tmp_path, trl.GRPOTrainer)
    inputs = micro_batch(len(detached.processing_class), detached.processing_class.pad_token_id)
    got, want = grads_of(detached, inputs), grads_of(theirs, inputs)
    assert all(torch.isfinite(grad).all() for grad in got.values())
    largest = max(((got[name] - grad).abs().max() / grad.abs().max()).item() for name, grad in want.items())
    assert largest > 100 * REL_TOL


def test_batch_size_not_a_multiple_of_num_generations_is_refused(example, tmp_path):
    with pytest.raises(ValueError, match="per_device_train_batch_size=6 is not a multiple of num_generations=4"):
        make(example, tmp_path, LongStrawGRPOTrainer, {"per_device_train_batch_size": 6, "num_generations": 4})


@pytest.mark.parametrize("setting", ["gradient_checkpointing", "use_liger_kernel", "cast_lm_head_to_fp32"])
def test_unsupported_settings_are_refused(example, tmp_path, setting):
    with pytest.raises(ValueError, match=f"{setting}=True .*set {setting}=False"):
        make(example, tmp_path, LongStrawGRPOTrainer, {setting: True})


def test_vision_inputs_are_refused(example, tmp_path):
    trainer = make(example, tmp_path, LongStrawGRPOTrainer)
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(LongStrawError, match=r"vision inputs \['pixel_values'\]"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, ids, 2, pixel_values=torch.zeros(2, 3))


def test_shuffle_groups_keeps_groups_whole():
    prompts = torch.arange(3).repeat_interleave(2)[:, None].expand(-1, 3)  # [6, 3]: prompt b in rows 2b, 2b+1
    batch = {"prompt_ids": prompts, "prompt_mask": torch.ones(6, 3), "rows": list(range(6)), "scalar": torch.tensor(1.0)}
    shuffled = shuffle_groups(batch, num_generations=2)
    assert shuffled["scalar"] is batch["scalar"]
    for block in range(3):
        rows = shuffled["rows"][2 * block : 2 * block + 2]
        assert rows[0] // 2 == rows[1] // 2
        assert (shuffled["prompt_ids"][2 * block] == prompts[rows[0]]).all()
    with pytest.raises(InputError, match="rows 0..1 of the generation batch"):
        shuffle_groups({**batch, "prompt_ids": torch.arange(6)[:, None]}, num_generations=2)


def test_example_runs(example, tmp_path):
    """Three steps of the example's loop, two generations: TRL generates,
    rewards, scores the reference and the old policy under no_grad and steps,
    all through LongStraw. Dynamo traces the scorer three times (reference,
    old policy, loss) and not again at the second generation: a recompile
    at every generation would soon hit Dynamo's limit and run eagerly."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    trainer = example.make_trainer(str(tmp_path), max_steps=3)
    trainer.train()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 3
    assert len(trainer.longstraw_backend.plans) == 3
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in trainer.state.log_history if "loss" in r)


def test_generation_prefills_each_prompt_once_and_samples_what_trl_does(example, tmp_path):
    """The trainer's HF generation (`shared_prefill`): one prefill forward of
    one row per distinct prompt, then the same completions as TRL's own
    `generate` over the repeated rows, under the same seed."""
    prompts = [[5, 6, 7, 8], [9, 10, 11]]  # the second one token shorter: left-padded
    rows = [p for p in prompts for _ in range(G)]
    completions = {}
    for share in (True, False):
        trainer = make(example, tmp_path, LongStrawGRPOTrainer, share_prefill=share)
        # the example turns HF's cache off: nothing to share without one
        trainer.model.config.use_cache = trainer.model.generation_config.use_cache = True
        shapes = []
        trainer.model.model.register_forward_pre_hook(
            lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
        torch.manual_seed(3)
        completions[share], _ = trainer._generate_single_turn(rows, None, {}, G)
        prefills = [s for s in shapes if s[1] > 1]
        assert prefills == ([(1, 2), (1, 3)] if share else [(2 * G, 4)])
    assert completions[True] == completions[False]
