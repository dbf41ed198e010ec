"""`LossModule`: the model and the loss in one module, for DDP and FSDP2.

DDP's forward and FSDP2's hooks cannot be traced: a wrapped model called
inside a compiled loss breaks the graph where it is called, and LongStraw
needs the whole loss in one graph. Wrapping the module whose forward
returns the loss, and compiling the wrapper, keeps the model and the loss
in one graph while DDP and FSDP2 act around it:

    torch._dynamo.config.optimize_ddp = False
    step = torch.compile(DDP(LossModule(model, grpo_loss)), backend="longstraw")

    module = LossModule(model, grpo_loss)
    fully_shard(module)
    step = torch.compile(module, backend="longstraw")

    loss = step(prompt_ids, response_ids, advantages, completion_mask)
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


class LossModule(nn.Module):
    """`forward(*args, **kwargs)` returns `loss_fn(model, *args, **kwargs)`.

    The model is registered as the submodule `model`, so its parameters are
    this module's (named `model.<name>`) and DDP or FSDP2 applied to it
    reduce their gradients."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.loss_fn(self.model, *args, **kwargs)
