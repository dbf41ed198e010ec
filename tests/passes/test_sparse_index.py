"""DeepSeek sparse attention (GLM-5, `glm_moe_dsa`): the indexer's top-k
selection over MLA (`passes/sparse_index.py`).

Float64 parity against eager HF in both modes (exact against the plain
eager loss, detached against HF's cached path, whose cache holds the same
latent, rope key and index key). `index_topk` is smaller than the prompt, so
the selection matters. The indexer scores in float32 and `torch.topk`'s
choice among equal scores is unspecified: every parity shape first checks
that no query of any layer has a tie (or a near-tie float32 rounding could
flip) across the k-th place (`boundary_gap`), so parity is claimed only
where the selection is unique.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm

import longstraw
from longstraw.errors import UnsupportedGraphError
from longstraw.passes import DEFAULT_PASSES, SparseLatentAttentionPass, sparse_index
from longstraw.runtime.kernels import latent_attention

from helpers.harness import assert_branch_order_does_not_matter, assert_parity, compile_loss
from helpers.losses import grpo_loss_f64
from helpers.parity import deterministic_algorithms
from helpers.reference import detached_reference, eager_loss_and_grads
from helpers.tiny_models import make_glm5, make_group

TOL = 1e-6  # HF norms and RoPE round through float32
MARGIN = 1e-5  # the k-th and (k+1)-th index scores of every query differ by more (float32 sums differ by ~1e-7)


def one_layer() -> torch.nn.Module:
    """One dense GLM-5 layer: what the planning and refusal tests need."""
    return make_glm5(experts=False, num_hidden_layers=1, mlp_layer_types=["dense"])


class IndexerInputs:
    """Records, per full indexer, its query, key and weights (float64, as HF
    computes them before its float32 casts) and the indices it returned."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, hf_glm.GlmMoeDsaIndexer]] = []
        self.handles = [m.register_forward_hook(self.record, with_kwargs=True)
                        for m in model.modules() if isinstance(m, hf_glm.GlmMoeDsaIndexer)]

    def record(self, module, args, kwargs, indices) -> None:
        hidden, q_resid, (cos, sin) = args[:3]
        batch, length, _ = hidden.shape
        with torch.no_grad():
            q = module.wq_b(q_resid).view(batch, length, module.n_heads, module.head_dim)
            k = module.k_norm(module.wk(hidden)).unsqueeze(2)
            rope = module.qk_rope_head_dim
            q_rot, k_rot = hf_glm.apply_rotary_pos_emb_interleave(q[..., :rope], k[..., :rope], cos, sin,
                                                                  unsqueeze_dim=2)
            q = torch.cat([q_rot, q[..., rope:]], -1)  # [B, L, H, D]
            k = torch.cat([k_rot, k[..., rope:]], -1).squeeze(2)  # [B, L, D]
            w = module.weights_proj(hidden) * module.n_heads ** -0.5  # [B, L, H]
        self.calls.append((q, k, w, indices, module))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """[L, L] float64 index scores of one row, later keys -inf."""
    scores = torch.einsum("lh,lhm->lm", w, torch.relu(torch.einsum("lhd,md->lhm", q, k) * scale))
    later = torch.ones_like(scores, dtype=torch.bool).triu(1)
    return scores.masked_fill(later, float("-inf"))


def boundary_gap(model: torch.nn.Module, group: tuple) -> float:
    """The smallest gap, over layers, rows and queries with more than k
    earlier positions, between the k-th and (k+1)-th index score."""
    prompt, responses = group[0], group[1]
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], 1)
    recorder = IndexerInputs(model)
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        recorder.close()
    gaps = []
    for q, k, w, _, module in recorder.calls:
        top = module.index_topk
        for row in range(ids.shape[0]):
            scores = index_scores(q[row], k[row], w[row], module.softmax_scale)[top:]  # queries with > k keys
            if len(scores):
                best = scores.topk(top + 1, dim=-1).values
                gaps.append(float((best[:, top - 1] - best[:, top]).min()))
    return min(gaps, default=float("inf"))


def check_parity(model, mode: str, shape: tuple, deterministic: bool = False, device: str = "cpu",
                 **options) -> None:
    G, P, R, chunk = shape
    group = tuple(t.to(device) for t in make_group(G, P, R, pad=True))
    assert boundary_gap(model, group) > MARGIN, "a tie across the k-th place: pick another shape or seed"
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=chunk, verify_state=True, **options)
    with deterministic_algorithms(deterministic), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*DSA top-k selection")  # LongStraw's steps saw no tie either
        got = assert_parity(grpo_loss_f64, backend, detached_reference, model, *group, tol=TOL)
    indexer = [name for name in got if ".indexer." in name]
    assert indexer and all(got[name] is None for name in indexer)  # eager's indexer runs under no_grad
    kinds = {s.reason.split(":")[0] for s in backend.plans[-1].partition.slots}
    assert kinds == {"sparse_latent_attention"}, kinds


# (G, P, R, prefix_chunk_size): chunks that do not divide the prompt, one
# chunk longer than the prompt, a 200-position prompt; index_topk = 8 < P
# throughout. CI runs one shape per mode, `-m slow` the rest.
SHAPES = [(3, 64, 6, 24), (2, 41, 5, 7), (4, 17, 3, 32), (3, 200, 5, 48)]
CASES = [
    pytest.param(mode, shape, marks=() if (mode, shape) in (("exact", SHAPES[0]), ("detached", SHAPES[1])) else
                 pytest.mark.slow, id="{}-G{}-P{}-R{}-chunk{}".format(mode, *shape))
    for mode in ("exact", "detached") for shape in SHAPES
]


@pytest.mark.parametrize("mode, shape", CASES)
def test_dense_and_moe_layers_match_eager(mode, shape):
    check_parity(make_glm5(), mode, shape)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_dense_layers_match_eager(mode):
    check_parity(make_glm5(experts=False), mode, (2, 40, 5, 16))


@pytest.mark.parametrize("mode", ["exact", pytest.param("detached", marks=pytest.mark.slow)])
def test_shared_indexer_layer_matches_eager(mode):
    """A "shared" layer reuses the previous layer's top-k (HF's
    `prev_topk_indices`): its step selects again from the same index key slot."""
    model = make_glm5(indexer_types=["full", "shared"])
    check_parity(model, mode, (3, 48, 5, 20))
    assert model.model.layers[1].self_attn.indexer is None


@pytest.mark.parametrize("mode", [pytest.param("exact", marks=pytest.mark.slow), "detached"])
def test_nan_filled_memory(mode):
    check_parity(make_glm5(), mode, (3, 37, 4, 10), deterministic=True)


def test_without_the_cache():
    """`use_cache=False`: traced without a cache, HF's causal mask goes
    through its packed-sequence check of the position ids, which `band_of`
    proves causal (an arange counts up by one: one sequence)."""
    model = make_glm5(experts=False)
    model.config.use_cache = False
    check_parity(model, "exact", (2, 40, 5, 16))


@pytest.mark.slow
def test_topk_covering_every_position_is_dense_mla():
    """index_topk >= P + R: every earlier position is selected, as in eager."""
    check_parity(make_glm5(index_topk=64), "exact", (2, 30, 5, 8))


@pytest.mark.slow  # CI: test_selection_equals_eager_for_every_query tiles the selection alone
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_key_tiles_and_blocks_of_few_positions(monkeypatch, mode):
    """Index key tiles of 3 (the running top-k merged across many tiles, a
    tile straddling the state and the step's own keys) and attention over
    the selected keys one query row at a time."""
    monkeypatch.setattr(sparse_index, "INDEX_KEY_TILE", 3)
    monkeypatch.setattr(latent_attention, "SELECTED_BLOCK_ELEMENTS", 1)
    check_parity(make_glm5(), mode, (2, 29, 4, 6))


@pytest.mark.slow
@pytest.mark.parametrize("option", ["recompute_layers", "attention_outputs_on_host"])
def test_options_match_eager(option):
    check_parity(make_glm5(), "exact", (3, 41, 5, 16), **{option: True})


@pytest.mark.parametrize("mode", [pytest.param("exact", marks=pytest.mark.slow), "detached"])
def test_branch_order_does_not_matter(mode):
    assert_branch_order_does_not_matter(make_glm5(), mode, make_group(4, 33, 5, pad=True), 8)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_cuda_matches_eager(mode):
    """Float64 on CUDA: the selection's tensors are made on the step's device."""
    check_parity(make_glm5().cuda(), mode, (3, 64, 6, 24), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_cuda_bf16_is_as_accurate_as_eager(mode):
    """bf16 on CUDA, where the selected attention's products run on TF32
    units (`runtime/kernels/latent_attention.py`, `_products_exact_for`): against float64, the
    worst parameter's gradient is no further off than eager bf16's (within
    a factor 2), and LongStraw's loss is eager's to bf16 rounding."""
    import copy

    from helpers.compare import rel_err
    from helpers.harness import compiled_loss_and_grads

    truth_model = make_glm5(experts=False).cuda()
    model = copy.deepcopy(truth_model).to(torch.bfloat16)
    group = tuple(t.cuda() for t in make_group(3, 96, 6, pad=True))
    truth_loss, truth = (detached_reference(truth_model, *group) if mode == "detached" else
                         eager_loss_and_grads(grpo_loss_f64, truth_model, *group))
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=40)
    loss, got = compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), model, *group)
    if mode == "exact":
        _, eager = eager_loss_and_grads(grpo_loss_f64, model, *group)
    else:
        _, eager = detached_reference(model, *group)
    worst = lambda grads: max(rel_err(grads[n].double(), truth[n]) for n in truth if truth[n] is not None)  # noqa: E731
    assert worst(got) <= 2 * worst(eager), (worst(got), worst(eager))
    assert rel_err(loss.double(), truth_loss) < 2e-2


# --- the selection -----------------------------------------------------------------------------


def selected_mask(selection: sparse_index.Selection, keys: int) -> torch.Tensor:
    """[n, keys]: which keys each query reads."""
    mask = torch.zeros(selection.positions.shape[0], keys + 1, dtype=torch.bool)
    return mask.scatter_(-1, torch.where(selection.valid, selection.positions, keys), True)[:, :keys]


@pytest.mark.parametrize("tile, budget", [(1, 1 << 24), (5, 1 << 24), (4096, 1 << 24), (4096, 200)],
                         ids=["tile1", "tile5", "one-tile", "score-budget"])
def test_selection_equals_eager_for_every_query(monkeypatch, tile, budget):
    """For every query of every row and layer, the tiled selection over
    `[earlier state | own keys]`, whatever the split point, picks exactly the
    positions eager's `topk` picked (restricted to earlier positions). The
    score budget cuts tiles to 200 // index heads keys and walks one query
    row at a time."""
    monkeypatch.setattr(sparse_index, "INDEX_KEY_TILE", tile)
    monkeypatch.setattr(sparse_index, "INDEX_BLOCK_SCORES", budget)
    model = make_glm5()
    prompt, responses, *_ = group = make_group(3, 40, 6)
    assert boundary_gap(model, group) > MARGIN
    recorder = IndexerInputs(model)
    try:
        with torch.no_grad():
            model(input_ids=torch.cat([prompt.expand(3, -1), responses], 1))
    finally:
        recorder.close()
    length = 46
    for q, k, w, eager, module in recorder.calls:
        for row in range(3):
            for o in (0, 17, 40):  # a prompt chunk from the start, one mid-prompt, the branch after the prompt
                selection = sparse_index.tiled_topk(q[row, o:], w[row, o:], k[row, :o], k[row, o:],
                                                    module.softmax_scale, module.index_topk)
                got = selected_mask(selection, length)
                want = torch.zeros(length - o, length, dtype=torch.bool)
                want.scatter_(-1, eager[row, o:].long(), True)
                want &= torch.ones(length, length, dtype=torch.bool).tril()[o:]
                assert torch.equal(got, want)


def test_ties_go_to_earlier_positions():
    """All index scores equal (a zero index query: relu gives 0 everywhere):
    each query with more than k earlier keys reads the first k positions,
    whatever the tiling, and the step warns. Eager's `torch.topk` picks
    among ties as it likes."""
    n, heads, dim, k = 12, 2, 4, 5
    query = torch.zeros(n, heads, dim)
    weights = torch.randn(n, heads)
    keys = torch.randn(20, dim)
    for o in (0, 8):
        for tile in (1, 3, 64):
            sparse_index.INDEX_KEY_TILE, before = tile, sparse_index.INDEX_KEY_TILE
            try:
                with pytest.warns(UserWarning, match="k-th and \\(k\\+1\\)-th index scores are equal"):
                    picked = selected_mask(sparse_index.tiled_topk(query, weights, keys[:o], keys[o:o + n], 1.0, k), o + n)
            finally:
                sparse_index.INDEX_KEY_TILE = before
            rows = picked
            for i in range(n):
                visible = o + i + 1
                assert rows[i].nonzero().flatten().tolist() == list(range(min(k, visible)))


class LargestTensors(TorchDispatchMode):
    """Records the shape of every tensor an operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_prompt_selection_is_tiled(monkeypatch):
    """No tensor the selection makes has more than `k + 1 + tile` keys: the
    prompt's own selection never builds its chunk x prompt (let alone
    P x P) score matrix."""
    P, chunk, tile = 96, 16, 8
    monkeypatch.setattr(sparse_index, "INDEX_KEY_TILE", tile)
    seen = LargestTensors()
    select = sparse_index.tiled_topk

    def recorded(*args):
        with seen:
            return select(*args)

    monkeypatch.setattr(sparse_index, "tiled_topk", recorded)
    model = make_glm5()
    compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=chunk))(model, *make_group(2, P, 4))
    k = model.config.index_topk
    assert seen.shapes
    assert max(s[-1] for s in seen.shapes if s) <= k + 1 + tile  # the best k + 1 so far (a tie check) and a tile
    assert max(torch.Size(s).numel() for s in seen.shapes) <= chunk * model.config.index_n_heads * (k + 1 + tile)


# --- what is captured --------------------------------------------------------------------------


def test_planner_simulates_the_step():
    """The memory planner runs the steps on fake tensors: the selection's
    tie check reads no values there."""
    model = one_layer()
    cfg = model.config
    report = longstraw.explain(grpo_loss_f64, model, *make_group(2, 20, 3), options={"prefix_chunk_size": 8})
    plan = report.plan(P=64, G=2, R=16)
    per_position = (cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim) * 8 * cfg.num_hidden_layers
    assert report.state_bytes_per_position == per_position
    assert plan.state >= 64 * per_position and plan.activations > 0


GLM5_ATTENTION = dict(  # GLM-5's (and GLM-5.1's) attention and indexer shapes; a narrow residual stream
    vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, mlp_layer_types=["dense"],
    num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_rope_head_dim=64,
    qk_nope_head_dim=192, v_head_dim=256, index_head_dim=128, index_n_heads=32, index_topk=2048,
)


def test_state_at_glm5_shapes(capsys):
    """512 + 64 + 128 values per layer and position (bf16: 1,408 bytes)
    against 64 x (192 + 64 + 256) decompressed K/V values (65,536 bytes).
    A CPU model with a narrow residual stream, as DeepSeek-V3's in
    tests/passes/test_mla.py, so CI checks it in seconds; every layer and expert of
    GLM-5.1 on the meta device: tests/planning/test_report.py (`-m slow`)."""
    config = transformers.GlmMoeDsaConfig(**GLM5_ATTENTION)
    model = transformers.GlmMoeDsaForCausalLM(config).to(torch.bfloat16)
    report = longstraw.explain(grpo_loss_f64, model, *make_group(2, 7, 3), options={"prefix_chunk_size": 4})
    per_head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    decompressed = config.num_attention_heads * per_head * 2
    with capsys.disabled():
        print(f"\nGLM-5 attention state per layer and position (bf16): latent + rope key + index key "
              f"{report.state_bytes_per_position:,} B, decompressed K/V {decompressed:,} B")
    assert report.state_bytes_per_position == (512 + 64 + 128) * 2
    assert decompressed == 65536


# --- what is refused ---------------------------------------------------------------------------


def test_other_indexer_forms_are_refused(monkeypatch):
    """An index score without the relu is not the proved form: refused,
    naming the SDPA, its module and this pass."""
    monkeypatch.setattr(hf_glm.F, "relu", torch.nn.functional.silu)
    with pytest.raises(UnsupportedGraphError, match=r"scaled_dot_product_attention.*self_attn.*top-k.*sparse_index"):
        compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=8))(one_layer(), *make_group(2, 20, 3))


def test_selection_over_attention_not_proved_mla_is_refused():
    """A bias on kv_b_proj: the attention is not the proved MLA, so the
    selection has no pass to run it (the general attention pass does not
    take a mask that depends on the inputs)."""
    model = one_layer()
    for layer in model.model.layers:
        old = layer.self_attn.kv_b_proj
        layer.self_attn.kv_b_proj = torch.nn.Linear(old.in_features, old.out_features, bias=True, dtype=torch.float64)
    with pytest.raises(UnsupportedGraphError, match=r"not proved to be multi-head latent attention"):
        compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=8))(model, *make_group(2, 20, 3))


def test_group_as_long_as_the_sequence_is_refused():
    """G == P + R: MLA's shape proof cannot tell the latent's axes apart,
    and no other pass runs a DSA selection."""
    with pytest.raises(UnsupportedGraphError, match=r"group size equals the sequence length \(8\)"):
        compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=4))(one_layer(), *make_group(8, 5, 3))


def test_sparse_pass_is_a_default_pass():
    assert any(isinstance(p, SparseLatentAttentionPass) for p in DEFAULT_PASSES)


def test_without_the_sparse_pass_the_selection_is_refused():
    """Disabled by name, the sparse pass leaves the selection to the causal
    attention pass, which refuses a top-k mask, naming the pass to enable."""
    backend = longstraw.Backend(prefix_chunk_size=8, disable_passes=["sparse_latent_attention"])
    with pytest.raises(UnsupportedGraphError, match=r"top-k.*`sparse_latent_attention` pass"):
        compile_loss(grpo_loss_f64, backend)(one_layer(), *make_group(2, 20, 3))
