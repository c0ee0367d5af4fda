"""TreeGatedDeltaNet / TreeMambaMixer: Megatron's GDN and Mamba-2 mixers over a prefix tree.

Oracles:
  (a) the same module run on each sample alone (its rows as a one-segment chain): outputs at the
      sample's rows and every parameter / input gradient (sum over samples of <out_i, G_i>);
  (b) Megatron's stock GatedDeltaNet / MambaMixer on ordinary sequences (a batch of 2 = a forest of
      two root chains) with the same weights, their kernels replaced by token-by-token recurrences
      written here (and, once, by the compat stand-ins);
  (c) TP2 and TP2+SP on 2 gloo ranks against TP1 with the same full weights.
float64 with tolerance ~1e-10 (1e-6 against the stock layers, which round some float64 values to
fp32), plus a float32 sanity run.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_tree.cpu import megatron_core as cpu_layer
from megatron_tree.compat.mixers import checkpoint_param_name, gdn_modules
from megatron_tree.megatron.gdn import TreeGatedDeltaNet, tree_gdn_module_spec
from megatron_tree.megatron.packed_seq import TreePackedSeqParams
from megatron_tree.tree import TreeLayout, pack

try:
    from forests import random_forest
    from dist import init_megatron, run_distributed
except ImportError:  # run from the repository root as tests.*
    from tests.forests import random_forest
    from tests.dist import init_megatron, run_distributed

HIDDEN = 16
F64 = dict(rtol=1e-10, atol=1e-10)
F32 = dict(rtol=2e-4, atol=2e-5)
# The stock layers round a few float64 quantities to fp32 (`alpha.float()`, `gate.float()`,
# `A_log.float()`, `dt_bias.float()`); ours stay float64. A wrong formula is off by O(0.1).
STOCK = dict(rtol=1e-6, atol=1e-6)

# One shared-prefix microbatch: forks at several depths, a sample that is a prefix of another, a
# duplicate, two trees, padding (pad_to_multiple_of) and a single-token sample.
SAMPLES = [
    [5, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11],
    [5, 1, 2, 3, 4, 6, 7, 2, 2],
    [5, 1, 2, 3, 9, 9, 9, 9, 1, 3, 3, 4, 5],
    [5, 1, 2],
    [5, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11],
    [7, 7, 3, 1],
    [7, 7, 3, 2, 8, 8],
    [4],
]


# ----------------------------------------------------------------------------- environment
def _ensure_megatron_tp1():
    """World-size-1 gloo group + Megatron TP1 state + CPU shims (idempotent inside a process)."""
    created = {"compat": not cpu_layer.is_enabled(), "pg": False, "mp": False}
    cpu_layer.enable(kernels=True)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        created["pg"] = True
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1)
        created["mp"] = True
    model_parallel_cuda_manual_seed(1234)
    return created


@pytest.fixture(scope="module")
def megatron_tp1():
    created = _ensure_megatron_tp1()
    yield
    from megatron.core import parallel_state as ps

    if created["mp"]:
        ps.destroy_model_parallel()
    if created["pg"]:
        dist.destroy_process_group()
    if created["compat"]:
        cpu_layer.disable()


def _config(dtype=torch.float64, tp=1, sp=False, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
                params_dtype=dtype, normalization="RMSNorm", activation_func=F.silu, hidden_dropout=0.0,
                attention_dropout=0.0, tensor_model_parallel_size=tp, sequence_parallel=sp,
                linear_conv_kernel_dim=4, linear_key_head_dim=4, linear_value_head_dim=3, linear_num_key_heads=2,
                linear_num_value_heads=4, mamba_state_dim=5, mamba_head_dim=3, mamba_num_groups=2,
                mamba_num_heads=4)
    base.update(kw)
    return TransformerConfig(**base)


def _build_gdn(cfg, dtype, **params):
    from megatron.core.transformer.spec_utils import build_module

    return build_module(tree_gdn_module_spec(**params), config=cfg, layer_number=1).to(dtype)


def _build_mamba(cfg, dtype, **params):
    from megatron.core.transformer.spec_utils import build_module
    from megatron_tree.megatron.mamba import tree_mamba_module_spec

    return build_module(tree_mamba_module_spec(**params), config=cfg, layer_number=1).to(dtype)


@torch.no_grad()
def _randomize(module, seed):
    """O(1) random parameters so every path matters (Megatron's init makes out_proj tiny)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(module.named_parameters()):
        r = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if name.endswith("A_log"):
            val = torch.log(0.3 + 2.0 * torch.rand(p.shape, generator=gen, dtype=torch.float64))
        elif "norm" in name:
            val = 1.0 + 0.3 * r
        elif name.endswith("dt_bias") or name.endswith("D"):
            val = 0.5 * r
        else:
            val = r * (0.5 if "conv1d" in name else 1.0 / max(p.shape[-1], 1) ** 0.5)
        p.copy_(val.to(p.dtype))


def _chain(length):
    return TreeLayout.from_segments([length], [-1])


def _params(layout):
    return TreePackedSeqParams(layout=layout)


def _close(a, b, tol, what):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a.double(), b.double(), **tol), f"{what}: max abs err {err:.3e}"


# ----------------------------------------------------------------------------- (a) tree vs per sample
def _tree_vs_samples(module, layout, samples, dtype, tol, seed=0):
    gen = torch.Generator().manual_seed(seed)
    N = layout.num_rows
    x = torch.randn(N, 1, HIDDEN, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    cots = [torch.randn(len(r), 1, HIDDEN, generator=gen, dtype=torch.float64).to(dtype) for r in samples]
    names, params = zip(*module.named_parameters())

    out, bias = module(x, None, packed_seq_params=_params(layout))
    assert bias is None and out.shape == (N, 1, HIDDEN)
    loss = sum((out[r] * G).sum() for r, G in zip(samples, cots))
    tree_grads = torch.autograd.grad(loss, (x,) + params)

    loss_ref = 0.0
    for i, (r, G) in enumerate(zip(samples, cots)):
        o, _ = module(x[r], None, packed_seq_params=_params(_chain(len(r))))
        _close(out[r].detach(), o.detach(), tol, f"output of sample {i}")
        loss_ref = loss_ref + (o * G).sum()
    ref_grads = torch.autograd.grad(loss_ref, (x,) + params)

    assert torch.isfinite(out).all()
    for name, a, b in zip(("input",) + names, tree_grads, ref_grads):
        _close(a, b, tol, f"grad of {name}")
    covered = torch.zeros(N, dtype=torch.bool)
    for r in samples:
        covered[r] = True
    assert covered[: layout.num_real_rows].all() and torch.isfinite(tree_grads[0]).all()


def _packed():
    mbs = pack(SAMPLES, 96, pad_to_multiple_of=16)
    assert len(mbs) == 1
    mb = mbs[0]
    assert mb.layout.num_padding > 0 and mb.stats.tree_token_ratio > 1.3
    return mb.layout, [mb.sample_rows(i) for i in range(len(SAMPLES))]


GDN_VARIANTS = [dict(), dict(conv_bias=True)]
MAMBA_VARIANTS = [dict(chunk_size=4), dict(chunk_size=8, D_has_hdim=True, rmsnorm=False)]


@pytest.mark.parametrize("variant", range(len(GDN_VARIANTS)))
def test_gdn_tree_equals_per_sample(megatron_tp1, variant):
    module = _build_gdn(_config(), torch.float64, **GDN_VARIANTS[variant])
    _randomize(module, 10 + variant)
    layout, samples = _packed()
    _tree_vs_samples(module, layout, samples, torch.float64, F64, seed=variant)
    if variant == 0:  # a second, independently built forest (deeper forks, single-row segments)
        layout, samples = random_forest(3, num_trees=2, max_len=6, max_depth=3)
        _tree_vs_samples(module, layout, samples, torch.float64, F64, seed=7)


@pytest.mark.parametrize("variant", range(len(MAMBA_VARIANTS)))
def test_mamba_tree_equals_per_sample(megatron_tp1, variant):
    module = _build_mamba(_config(), torch.float64, **MAMBA_VARIANTS[variant])
    _randomize(module, 20 + variant)
    layout, samples = _packed()
    _tree_vs_samples(module, layout, samples, torch.float64, F64, seed=variant)
    if variant == 0:
        layout, samples = random_forest(3, num_trees=2, max_len=6, max_depth=3)
        _tree_vs_samples(module, layout, samples, torch.float64, F64, seed=7)


@pytest.mark.parametrize("kind", ["gdn", "mamba"])
def test_float32_sanity(megatron_tp1, kind):
    build = _build_gdn if kind == "gdn" else _build_mamba
    module = build(_config(torch.float32), torch.float32)
    _randomize(module, 30)
    layout, samples = _packed()
    _tree_vs_samples(module, layout, samples, torch.float32, F32, seed=3)


# ----------------------------------------------------------------------------- (b) stock Megatron modules
def _naive_l2norm(x, dim=-1, eps=1e-6, **_):
    return x / torch.sqrt((x * x).sum(dim, keepdim=True) + eps)


def _naive_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                            use_qk_l2norm_in_kernel=False, **_):
    """Token-by-token gated delta rule, FLA layout [B, T, H, D] (q/k already repeated to H = HV)."""
    assert initial_state is None and not use_qk_l2norm_in_kernel
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float64)
    outs = []
    for t in range(T):
        S = S * g[:, t].double().exp()[..., None, None]
        kt = k[:, t].double()
        u = beta[:, t].double()[..., None] * (v[:, t].double() - torch.einsum("bhk,bhkv->bhv", kt, S))
        S = S + kt[..., None] * u[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t].double() * scale, S))
    return torch.stack(outs, 1).to(v.dtype), None


def _naive_ssd_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                    cu_seqlens=None, dt_softplus=False, return_final_states=False, return_varlen_states=False, **_):
    """Token-by-token Mamba-2 scan, mamba-ssm layout x [b, L, H, P], dt [b, L, H], B/C [b, L, G, S]."""
    assert initial_states is None and seq_idx is None and cu_seqlens is None and not return_final_states
    b, L, H, P = x.shape
    rep = H // B.shape[2]
    dt = dt.double() + (0.0 if dt_bias is None else dt_bias.double())
    if dt_softplus:
        dt = F.softplus(dt)
    Bh, Ch = B.double().repeat_interleave(rep, 2), C.double().repeat_interleave(rep, 2)
    h = x.new_zeros(b, H, P, B.shape[-1], dtype=torch.float64)
    ys = []
    for t in range(L):
        h = h * torch.exp(dt[:, t] * A.double())[..., None, None] \
            + dt[:, t][..., None, None] * x[:, t].double()[..., None] * Bh[:, t][:, :, None, :]
        ys.append((h * Ch[:, t][:, :, None, :]).sum(-1))
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + x.double() * (D.double()[:, None] if D.dim() == 1 else D.double())
    if z is not None:
        y = y * F.silu(z.double())
    return y.to(x.dtype)


def _stock_vs_tree(stock, tree, L, seed):
    """Stock module on a [L, 2, h] batch vs the tree module on a forest of two root chains."""
    tree.load_state_dict(stock.state_dict())
    # Checkpoints are Megatron's own: same sharded keys (TP-agnostic q/k/v/z/... splits included).
    # Compared by checkpoint key (what lands on disk; 0.19.x's Mamba conv parameters are named
    # conv1d_weight but keep the key conv1d.weight).
    keys = {sh.key for sh in tree.sharded_state_dict().values()}
    assert keys == {sh.key for sh in stock.sharded_state_dict().values()}
    assert {"in_proj.weight", "A_log", "conv1d.weight"} <= keys
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(L, 2, HIDDEN, generator=gen, dtype=torch.float64).requires_grad_()
    G = torch.randn(L, 2, HIDDEN, generator=gen, dtype=torch.float64)
    out_s, _ = stock(x, None)
    gs = torch.autograd.grad((out_s * G).sum(), (x,) + tuple(stock.parameters()))

    x_tree = x.transpose(0, 1).reshape(2 * L, 1, HIDDEN)  # sequence b occupies rows b*L .. b*L+L-1
    layout = TreeLayout.from_segments([L, L], [-1, -1])
    out_t, _ = tree(x_tree, None, packed_seq_params=_params(layout))
    gt = torch.autograd.grad((out_t * G.transpose(0, 1).reshape(2 * L, 1, HIDDEN)).sum(),
                             (x,) + tuple(tree.parameters()))
    _close(out_t.reshape(2, L, HIDDEN).transpose(0, 1), out_s, STOCK, "output vs stock")
    for (name, _), a, b in zip([("input", None)] + list(tree.named_parameters()), gt, gs):
        _close(a, b, STOCK, f"grad of {name} vs stock")


def test_gdn_matches_stock_megatron(megatron_tp1, monkeypatch):
    from megatron.core.ssm import gated_delta_net as stock_mod

    cfg = _config()
    spec = tree_gdn_module_spec(conv_bias=True)
    stock = stock_mod.GatedDeltaNet(cfg, spec.submodules, layer_number=1, conv_bias=True,
                                    pg_collection=_tp1_groups()).double()
    tree = TreeGatedDeltaNet(cfg, spec.submodules, layer_number=1, conv_bias=True).double()
    _randomize(stock, 40)
    for module in gdn_modules():  # 0.16.1: one module; 0.19.x: the package and its submodules
        monkeypatch.setattr(module, "chunk_gated_delta_rule", _naive_gated_delta_rule)
        monkeypatch.setattr(module, "l2norm", _naive_l2norm, raising=False)
    if hasattr(stock, "gated_delta_rule"):  # 0.19.x keeps the kernel it found at construction
        monkeypatch.setattr(stock, "gated_delta_rule", _naive_gated_delta_rule)
    # The stock gated norm is torch.compile'd (jit_fuser); compiling on CPU adds nothing to the maths.
    with torch.compiler.set_stance("force_eager"):
        _stock_vs_tree(stock, tree, 11, seed=41)


@pytest.mark.parametrize("mem_eff", [False, True])
def test_mamba_matches_stock_megatron(megatron_tp1, monkeypatch, mem_eff):
    from megatron_tree.megatron.mamba import TreeMambaMixer, mamba_mixer_module

    stock_mod = mamba_mixer_module()
    cfg = _config(use_mamba_mem_eff_path=mem_eff)
    subs = stock_mod.MambaMixerSubmodules(in_proj=_linears()[0], out_proj=_linears()[1])
    stock = stock_mod.MambaMixer(cfg, subs, HIDDEN, chunk_size=4, layer_number=1,
                                 pg_collection=_tp1_groups()).double()
    tree = TreeMambaMixer(cfg, subs, chunk_size=4, layer_number=1).double()
    _randomize(stock, 50 + mem_eff)
    if not mem_eff:  # _ssm_prefill: stock nn.Conv1d + the scan written above
        monkeypatch.setattr(stock_mod, "mamba_chunk_scan_combined", _naive_ssd_scan)
    # mem_eff: the fused split-conv-scan path through the compat stand-ins
    _stock_vs_tree(stock, tree, 10, seed=51 + mem_eff)


def _linears():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear


def _tp1_groups():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])


# ----------------------------------------------------------------------------- layer protocol and errors
def test_mixers_inside_megatron_layers(megatron_tp1):
    """Both mixers work as the self_attention of a TransformerLayer (and Mamba as a MambaLayer mixer)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
    from megatron_tree.megatron.mamba import tree_mamba_module_spec

    cfg = _config(bias_dropout_fusion=False)
    layout, _ = _packed()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(layout.num_rows, 1, HIDDEN, generator=gen, dtype=torch.float64)
    for mixer_spec in (tree_gdn_module_spec(use_transformer_engine=False, normalization="RMSNorm"),
                       tree_mamba_module_spec(use_transformer_engine=False, normalization="RMSNorm", chunk_size=4)):
        layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm, self_attention=mixer_spec, self_attn_bda=get_bias_dropout_add))
        layer = layer(config=cfg, layer_number=1).double()
        _randomize(layer, 60)
        out, _ = layer(x, attention_mask=None, rotary_pos_emb=None, packed_seq_params=_params(layout))
        mixed, _ = layer.self_attention(layer.input_layernorm(x), None, packed_seq_params=_params(layout))
        _close(out, x + mixed, F64, f"TransformerLayer with {type(layer.self_attention).__name__}")

    layer = MambaLayer(cfg, MambaLayerSubmodules(norm=WrappedTorchNorm, mixer=tree_mamba_module_spec(chunk_size=4),
                                                 mamba_bda=get_bias_dropout_add), layer_number=1,
                       pg_collection=_tp1_groups()).double()
    _randomize(layer, 61)
    out = layer(x, packed_seq_params=_params(layout))
    mixed, _ = layer.mixer(layer.norm(x), packed_seq_params=_params(layout))
    _close(out, x + mixed, F64, "MambaLayer with TreeMambaMixer")


def test_clear_errors(megatron_tp1):
    from megatron_tree.megatron.mamba import TreeMambaMixer

    gdn = _build_gdn(_config(), torch.float64)
    mamba = _build_mamba(_config(), torch.float64)
    assert isinstance(mamba, TreeMambaMixer)
    layout = _chain(6)
    for module in (gdn, mamba):
        with pytest.raises(ValueError, match="micro-batch size must be 1"):
            module(torch.zeros(6, 2, HIDDEN, dtype=torch.float64), None, packed_seq_params=_params(layout))
        with pytest.raises(ValueError, match="TreePackedSeqParams"):
            module(torch.zeros(6, 1, HIDDEN, dtype=torch.float64), None)
        with pytest.raises(ValueError, match="layout has 6"):
            module(torch.zeros(5, 1, HIDDEN, dtype=torch.float64), None, packed_seq_params=_params(layout))


# ----------------------------------------------------------------------------- (c) tensor parallelism
GDN_SECTIONS = {  # TP1 weight -> (sections along the split dim, dim); None: replicated
    "in_proj.weight": (["qk", "qk", "v", "v", "hv", "hv"], 0), "conv1d.weight": (["qk", "qk", "v"], 0),
    "conv1d.bias": (["qk", "qk", "v"], 0), "dt_bias": (["hv"], 0), "A_log": (["hv"], 0),
    "out_norm.weight": None, "out_proj.weight": (["v"], 1)}
MAMBA_SECTIONS = {
    "in_proj.weight": (["d", "d", "gs", "gs", "h"], 0), "conv1d.weight": (["d", "gs", "gs"], 0),
    "conv1d.bias": (["d", "gs", "gs"], 0), "dt_bias": (["h"], 0), "A_log": (["h"], 0), "D": (["h"], 0),
    "norm.weight": (["d"], 0), "out_proj.weight": (["d"], 1)}


def _section_sizes(cfg):
    return {"qk": cfg.linear_key_head_dim * cfg.linear_num_key_heads,
            "v": cfg.linear_value_head_dim * cfg.linear_num_value_heads, "hv": cfg.linear_num_value_heads,
            "d": cfg.mamba_head_dim * cfg.mamba_num_heads, "gs": cfg.mamba_state_dim * cfg.mamba_num_groups,
            "h": cfg.mamba_num_heads}


def _shard(full, spec, sizes, rank, tp):
    """This rank's slice of a TP1 tensor: every section is split over TP separately, as Megatron's
    column-parallel in_proj / conv lay their local rows out (and its sharded_state_dict splits them)."""
    if spec is None:
        return full
    names, dim = spec
    parts = torch.split(full, [sizes[n] for n in names], dim=dim)
    return torch.cat([p.chunk(tp, dim=dim)[rank] for p in parts], dim=dim)


def _named_parameters(module):
    """``named_parameters`` under the checkpoint names (the same on every megatron-core version)."""
    return [(checkpoint_param_name(n), p) for n, p in module.named_parameters()]


def _tp_rank_body(full_states, x, cot, layout_args):
    """On each of 2 ranks: TP2 and TP2+SP runs of both mixers; returns outputs and gradients."""
    init_megatron(tp=2, kernels=True)
    rank, tp = dist.get_rank(), 2
    layout = TreeLayout.from_segments(*layout_args[:2], num_padding=layout_args[2])
    results = {}
    for kind, sections in (("gdn", GDN_SECTIONS), ("mamba", MAMBA_SECTIONS)):
        for sp in (False, True):
            cfg = _config(tp=tp, sp=sp)
            module = (_build_gdn if kind == "gdn" else _build_mamba)(cfg, torch.float64, **_KIND_PARAMS[kind])
            sizes = _section_sizes(cfg)
            local = {k: _shard(v, sections[k], sizes, rank, tp) for k, v in full_states[kind].items()}
            with torch.no_grad():
                for name, p in _named_parameters(module):
                    assert p.shape == local[name].shape, (name, p.shape, local[name].shape)
                    p.copy_(local[name])
            n = layout.num_rows // tp
            rows = slice(rank * n, (rank + 1) * n) if sp else slice(None)
            xin = x[rows].clone().requires_grad_()
            out, _ = module(xin, None, packed_seq_params=_params(layout))
            names, params = zip(*_named_parameters(module))
            grads = torch.autograd.grad((out * cot[rows]).sum(), (xin,) + params)
            grads = dict(zip(("input",) + names, grads))
            for name, p in zip(names, params):
                # finalize_model_grads' TP all-reduce of sequence-parallel (replicated) parameters
                if sp and getattr(p, "sequence_parallel", False):
                    dist.all_reduce(grads[name])
            results[(kind, sp)] = (out.detach(), grads)
    return results


_KIND_PARAMS = {"gdn": dict(conv_bias=True), "mamba": dict(chunk_size=4)}


def test_tensor_parallel_matches_tp1(megatron_tp1):
    layout, _ = _packed()
    assert layout.num_rows % 2 == 0
    gen = torch.Generator().manual_seed(70)
    x = torch.randn(layout.num_rows, 1, HIDDEN, generator=gen, dtype=torch.float64)
    cot = torch.randn(layout.num_rows, 1, HIDDEN, generator=gen, dtype=torch.float64)
    cfg = _config()
    refs, states = {}, {}
    for kind in ("gdn", "mamba"):
        module = (_build_gdn if kind == "gdn" else _build_mamba)(cfg, torch.float64, **_KIND_PARAMS[kind])
        _randomize(module, 71)
        states[kind] = {k: p.detach().clone() for k, p in _named_parameters(module)}
        assert set(states[kind]) == set(GDN_SECTIONS if kind == "gdn" else MAMBA_SECTIONS)
        xin = x.clone().requires_grad_()
        out, _ = module(xin, None, packed_seq_params=_params(layout))
        names, params = zip(*_named_parameters(module))
        grads = torch.autograd.grad((out * cot).sum(), (xin,) + params)
        refs[kind] = (out.detach(), dict(zip(("input",) + names, grads)))

    seg = layout.segment_lengths[: layout.num_segments - layout.num_padding].tolist()
    par = layout.segment_parent[: layout.num_segments - layout.num_padding].tolist()
    ranks = run_distributed(_tp_rank_body, 2, states, x, cot, (seg, par, layout.num_padding), timeout=240)

    sizes = _section_sizes(cfg)
    n = layout.num_rows // 2
    for kind, sections in (("gdn", GDN_SECTIONS), ("mamba", MAMBA_SECTIONS)):
        out_ref, grads_ref = refs[kind]
        for sp in (False, True):
            for rank, res in enumerate(ranks):
                out, grads = res[(kind, sp)]
                rows = slice(rank * n, (rank + 1) * n) if sp else slice(None)
                what = f"{kind} TP2{'+SP' if sp else ''} rank {rank}"
                _close(out, out_ref[rows], F64, f"{what} output")
                _close(grads["input"], grads_ref["input"][rows], F64, f"{what} input grad")
                for name, g in grads.items():
                    if name != "input":
                        ref = _shard(grads_ref[name], sections[name], sizes, rank, 2)
                        _close(g, ref, F64, f"{what} grad of {name}")
