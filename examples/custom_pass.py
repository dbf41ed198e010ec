"""Teaching LongStraw a position-mixing operator it does not know.

A model of your own mixes positions with a causal exponential moving
average, written as a custom operator (`example::ema`). LongStraw cannot
know what that operator reads from earlier positions, so it refuses the
loss and says which operator and what to do. The pass below tells it: the
operator's past is one fixed-size state (the last average, `[B, C]`), and
here is how to run it from that state. With the pass, the compiled loss
and every gradient match eager PyTorch in float64.

    python examples/custom_pass.py
"""

from __future__ import annotations

import torch
from torch import nn

import longstraw
from longstraw.passes import CarryPass

G, P, R, VOCAB, CHANNELS = 3, 40, 12, 64, 16


def ema_reference(x: torch.Tensor, decay: torch.Tensor, state: torch.Tensor | None = None):
    """y_t = decay * y_(t-1) + (1 - decay) * x_t along dim 1 of x [B, L, C],
    from y_(-1) = state [B, C] (zeros when None). Returns (y, y at the last position)."""
    length = x.shape[1]
    t = torch.arange(length, dtype=x.dtype, device=x.device)
    steps = (t[:, None] - t[None, :]).clamp_min(0)  # [L, L]: t - s
    weights = (1 - decay) * decay ** steps[..., None]  # [L, L, C]
    weights = weights * (t[:, None] >= t[None, :])[..., None]
    y = torch.einsum("tsc,bsc->btc", weights, x)
    if state is not None:
        y = y + decay ** (t[:, None] + 1) * state[:, None, :]
    return y, y[:, -1]


@torch.library.custom_op("example::ema", mutates_args=())
def ema(x: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    return ema_reference(x, decay)[0]


@ema.register_fake
def _(x, decay):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    with torch.enable_grad():
        x, decay = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        return torch.autograd.grad(ema_reference(x, decay)[0], (x, decay), grad)


ema.register_autograd(_backward, setup_context=_setup)


class EmaBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(CHANNELS)
        self.logit_decay = nn.Parameter(torch.randn(CHANNELS))
        self.proj = nn.Linear(CHANNELS, CHANNELS)
        self.mlp = nn.Sequential(nn.Linear(CHANNELS, 4 * CHANNELS), nn.GELU(), nn.Linear(4 * CHANNELS, CHANNELS))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.proj(ema(self.norm(h), torch.sigmoid(self.logit_decay)))
        return h + self.mlp(h)


class EmaLM(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, CHANNELS)
        self.blocks = nn.ModuleList(EmaBlock() for _ in range(layers))
        self.head = nn.Linear(CHANNELS, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def grpo_loss(model, prompt, responses, advantages, mask):
    """Sequence-mean policy-gradient loss over `[prompt; response_g]`."""
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = model(ids)[:, prompt.shape[0] - 1 : -1]
    logp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    return -((logp * mask).sum(1) / mask.sum(1) * advantages).mean()


class EmaPass(CarryPass):
    """`example::ema(x, decay)`: positions along dim 1 of x, group rows
    along dim 0; the carried state is the last average, `[1, C]` per row."""

    name = "ema"
    op = torch.ops.example.ema.default
    sequence = (0, 1)

    def carry(self, node):
        x = node.args[0].meta["longstraw_value"]
        return (1, x.shape[-1]), x.dtype

    def step_inputs(self, node):
        x, decay = node.args
        return (x, decay), {}

    def kernel(self, inputs, **constants):
        return longstraw.CarryKernel(
            forward=lambda state, x, decay: ema_reference(x, decay, state),
            token_dims=(1, 1, None),  # output, x: positions on dim 1; decay: not per position
        )


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def main() -> None:
    torch.manual_seed(0)
    model = EmaLM().double()
    prompt = torch.randint(0, VOCAB, (P,))
    responses = torch.randint(0, VOCAB, (G, R))
    advantages = torch.randn(G, dtype=torch.float64)
    mask = torch.ones(G, R, dtype=torch.float64)
    args = (model, prompt, responses, advantages, mask)

    print("1. Without a pass for example::ema, LongStraw refuses the loss:")
    try:
        torch.compile(grpo_loss, backend="longstraw")(*args)
        raise SystemExit("expected LongStraw to refuse an operator it does not know")
    except longstraw.LongStrawError as e:
        print("   " + str(e).replace("\n", "\n   "))
    torch._dynamo.reset()

    print("\n2. With EmaPass (exact gradients, the prompt captured in chunks of 16):")
    loss = grpo_loss(*args)
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    options = {"passes": [EmaPass()], "prefix_chunk_size": 16}
    compiled = torch.compile(grpo_loss, backend="longstraw", options={**options, "verify_state": True})
    got_loss = compiled(*args)
    got_loss.backward()
    errors = {n: relative_error(p.grad, want[n]) for n, p in model.named_parameters()}
    worst = max(errors, key=errors.get)
    print(f"   parity against eager (float64): loss {relative_error(got_loss, loss):.1e}, "
          f"worst gradient {errors[worst]:.1e} ({worst})")
    assert relative_error(got_loss, loss) < 1e-10 and errors[worst] < 1e-10, errors
    print("\n3. What LongStraw captures per prompt position (`longstraw.explain`):")
    print(longstraw.explain(grpo_loss, *args, options=options).state_table())


if __name__ == "__main__":
    main()
