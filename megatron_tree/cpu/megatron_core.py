"""Explicit shims that let Megatron-Core 0.16.1 run on CPU with the gloo backend.

Megatron-Core assumes CUDA in a handful of places that have nothing to do with the maths: it
places tensors with ``torch.cuda.current_device()``, allocates a few counters with a literal
``device="cuda"``, keeps the dropout RNG streams in CUDA generators, synchronises CUDA after p2p
and refuses sequence parallelism for the plain torch norm. On a CPU-only host each of those
raises, so nothing of Megatron can be tested there. :func:`enable` patches exactly those spots.

Rules the shims follow:

* Nothing happens on import. :func:`enable` is explicit, idempotent, returns ``False`` and does
  nothing when CUDA is available (the real code is right there), ``True`` when the shims are
  active. :func:`disable` restores every original (used by tests).
* Narrow: module attributes and class attributes of ``megatron.core`` only. The global ``torch``
  module is never modified; Megatron modules that call CUDA helpers get a private view of
  ``torch`` (:class:`_CpuTorch`) in their own namespace. Every change is recorded in
  :func:`applied` with the reason.
* Each shim gives a CUDA-only call its CPU meaning (most of them raise on a CPU-only host);
  code paths that never touch CUDA behave as before.

Seeding on CPU: the CPU default generator plays the role of the "CUDA" default generator, so
``model_parallel_cuda_manual_seed(seed)`` re-seeds the CPU generator with ``seed`` (as Megatron-LM's
``_set_random_seed`` does anyway) and the tracker's named streams are CPU generator states.
``use_cpu_initialization=True`` draws full weights from that generator and then splits them, so
seeding every rank the same way gives weights that do not depend on the TP size.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.abc
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

# Megatron modules enable() imports so that their CUDA call sites can be patched up front. A
# module imported later is patched on import by _PatchOnImport.
_CORE_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.transformer.torch_norm",
    "megatron.core.transformer.module",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.mlp",
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.rerun_state_machine",
    "megatron.core.timers",
)

# A Megatron module gets the CPU view of torch when its source contains one of these call sites.
_CUDA_CALL_SITE = re.compile(
    r"torch\.cuda\.(current_device|synchronize|get_rng_state|set_rng_state|manual_seed|empty_cache|Stream|stream"
    r"|current_stream)\s*\("
    r"|device\s*=\s*['\"]cuda['\"]"
    r"|pin_memory\s*=\s*True"
)


# ----------------------------------------------------------------------------------------------
# Record of what was patched
# ----------------------------------------------------------------------------------------------
@dataclass
class Patch:
    """One attribute replaced by :func:`enable`: ``target.name`` was ``original``."""

    target: Any
    name: str
    original: Any
    had_attr: bool
    why: str

    def describe(self) -> str:
        if self.target is sys.modules:
            return f"sys.modules[{self.name!r}]: {self.why}"
        owner = getattr(self.target, "__name__", None) or type(self.target).__name__
        return f"{owner}.{self.name}: {self.why}"


_PATCHES: list[Patch] = []
_PATCHED_KEYS: set[tuple[int, str]] = set()
_LOCK = threading.RLock()
_ENABLED = False
_KERNELS = False


def _set(target: Any, name: str, value: Any, why: str) -> None:
    """Replace ``target.name`` by ``value`` once, remembering the original for :func:`disable`."""
    key = (id(target), name)
    if key in _PATCHED_KEYS:
        return
    if isinstance(target, dict):  # sys.modules entries
        had, original = name in target, target.get(name)
        target[name] = value
    else:
        # Classes: read the raw class attribute (e.g. a staticmethod) so disable() restores it as is.
        namespace = vars(target) if isinstance(target, type) else None
        had = name in namespace if namespace is not None else hasattr(target, name)
        original = namespace.get(name) if namespace is not None else getattr(target, name, None)
        setattr(target, name, value)
    _PATCHES.append(Patch(target, name, original, had, why))
    _PATCHED_KEYS.add(key)


def applied() -> list[str]:
    """Human-readable list of the active patches, in the order they were applied."""
    hook = ["sys.meta_path: megatron.core modules imported later get the CPU view of torch"] \
        if _IMPORT_HOOK in sys.meta_path else []
    return [p.describe() for p in _PATCHES] + hook


def is_enabled() -> bool:
    """True while the CPU shims are active."""
    return _ENABLED


# ----------------------------------------------------------------------------------------------
# Private CPU view of torch for Megatron modules
# ----------------------------------------------------------------------------------------------
def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``, an int) to CPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _on_cpu(factory: Callable) -> Callable:
    """Wrap a tensor factory so CUDA placement becomes CPU and ``pin_memory`` is dropped
    (pinning needs an accelerator; on CPU it has no meaning)."""

    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return factory(*args, **kwargs)

    wrapper.__name__ = getattr(factory, "__name__", "factory")
    wrapper.__doc__ = f"CPU-placing wrapper of torch.{wrapper.__name__} (megatron_tree.cpu.megatron_core)."
    return wrapper


class _CpuCuda:
    """``torch.cuda`` as seen by a patched Megatron module on a CPU-only host.

    Everything is forwarded to the real ``torch.cuda`` except the calls that would raise for lack
    of a device: the current device is the CPU, synchronisation is a no-op (CPU ops and gloo
    collectives are synchronous), and the default "CUDA" RNG is the CPU default generator.
    """

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    # CPU ops are synchronous: a "stream" is a context that does nothing (MoE's alltoall dispatcher
    # creates a device-to-host side stream and waits on / records events on it).
    @staticmethod
    def Stream(*args, **kwargs) -> "_CpuStream":  # noqa: N802 (torch's name)
        return _CpuStream()

    @staticmethod
    def current_stream(device: Any = None) -> "_CpuStream":
        return _CPU_STREAM

    @staticmethod
    def stream(stream: Any = None) -> "contextlib.AbstractContextManager":
        return contextlib.nullcontext()


class _CpuStream:
    """No-op stand-in for ``torch.cuda.Stream`` / ``Event`` on a CPU host."""

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> "_CpuStream":
        return self

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _CpuStream)

    __hash__ = object.__hash__


_CPU_STREAM = _CpuStream()


_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
              "as_tensor", "empty_like", "zeros_like", "ones_like", "full_like", "linspace")


class _CpuTorch:
    """``torch`` as seen by a patched Megatron module: the real module with a CPU ``cuda`` and
    tensor factories that place ``device="cuda"`` requests on the CPU. Attribute access is
    forwarded, so ``torch.Tensor``, ``torch.distributed`` etc. are the real objects."""

    cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def __repr__(self) -> str:
        return "<torch (CPU view, megatron_tree.cpu.megatron_core)>"


for _name in _FACTORIES:
    setattr(_CpuTorch, _name, staticmethod(_on_cpu(getattr(torch, _name))))
_CPU_TORCH = _CpuTorch()


def patch_module(module: Any) -> bool:
    """Give ``module`` (a Megatron module object) the CPU view of torch if it has CUDA call sites.

    Returns True when the module was (or already is) patched. Exposed so that callers importing
    more Megatron modules after :func:`enable` can cover them; :func:`enable` does it for every
    loaded ``megatron.core`` module.
    """
    if not _ENABLED:
        raise RuntimeError("megatron_tree.cpu.enable() has not been applied")
    return _patch_module(module)


_CPU_VIEW_WHY = ("module-level torch -> CPU view: torch.cuda.current_device()/synchronize()/RNG calls and "
                 "device='cuda'/pin_memory allocations run on the CPU")


def _patch_module(module: Any, view: Any = None, call_site: "re.Pattern | None" = None, why: str = _CPU_VIEW_WHY) -> bool:
    """Replace ``module``'s module-level ``torch`` by ``view`` (default the CPU view) when its source
    has a ``call_site`` match (default: CUDA call sites). True when it is (or already was) patched."""
    view = _CPU_TORCH if view is None else view
    call_site = _CUDA_CALL_SITE if call_site is None else call_site
    namespace = vars(module)
    if namespace.get("torch") is view:
        return True
    if namespace.get("torch") is not torch:
        return False
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError:
        return False
    if not call_site.search(source):
        return False
    _set(module, "torch", view, why)
    return True


class _PatchingLoader(importlib.abc.Loader):
    """Loader wrapper: runs the real loader, then gives the new module the CPU view of torch."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        if _ENABLED:
            _patch_module(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, ...
        return getattr(self._inner, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Meta-path hook active while the shims are on: a ``megatron.core`` module imported after
    :func:`enable` gets the CPU view of torch as soon as it has executed, so callers need not
    re-run :func:`enable` after importing more of Megatron."""

    def find_spec(self, name, path, target=None):
        if not _ENABLED or not name.startswith("megatron.core."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader)
        return spec


_IMPORT_HOOK = _PatchOnImport()


def _patch_loaded_megatron_modules() -> None:
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "megatron.core" or name.startswith("megatron.core.")):
            _patch_module(module)


# ----------------------------------------------------------------------------------------------
# RNG: the CUDA RNG tracker on top of the CPU default generator
# ----------------------------------------------------------------------------------------------
def _get_rng_state_cpu(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """CPU stand-in for ``random._get_cuda_rng_state``: the state of the CPU default generator
    (``torch.get_rng_state`` already returns a copy). CUDA-graph-safe states have no CPU meaning."""
    if graph_safe:
        raise RuntimeError("graph-safe (CUDA graph) RNG states are not available on CPU")
    return torch.get_rng_state()


def _set_rng_state_cpu(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """CPU stand-in for ``random._set_cuda_rng_state``."""
    if graph_safe:
        raise RuntimeError("graph-safe (CUDA graph) RNG states are not available on CPU")
    torch.set_rng_state(new_state)


def _tracker_add(self, name: str, seed: int) -> None:
    """``CudaRNGStatesTracker.add`` on CPU: store the CPU generator state seeded with ``seed``
    under ``name`` and leave the current state untouched."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    if getattr(self, "use_cudagraphable_rng", False):
        raise RuntimeError("use_cudagraphable_rng needs CUDA graphs; not available on CPU")
    outer = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(outer)


def _make_tracker_fork(default_name: str):
    @contextlib.contextmanager
    def fork(self, name: str = default_name):
        """``CudaRNGStatesTracker.fork`` on CPU: run the body with the named CPU generator state,
        save where it ended, and restore the outer state. Nested forks save the outer named
        stream first, as the CUDA version does. The CUDA version warns when the CPU state moves
        inside the fork; here that is the point, so there is no warning."""
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer_name = self._current_state_name
        outer_state = torch.get_rng_state()
        if outer_name != "default-rng":
            self.states_[outer_name] = outer_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise Exception(f"current rng state {self._current_state_name} is not {name}")
            self.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                outer_state = self.states_[outer_name]
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name

    return fork


# ----------------------------------------------------------------------------------------------
# Other narrow shims
# ----------------------------------------------------------------------------------------------
def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """CPU version of ``rope_utils.get_pos_emb_on_this_cp_rank`` (the original pins memory and
    calls ``.cuda()``). Same contract: the sequence is cut into ``2*cp`` equal chunks and rank
    ``r`` keeps chunks ``r`` and ``2*cp-1-r`` (Megatron's load-balanced CP order)."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    if pos_emb.shape[seq_dim] % (2 * cp_size):
        raise ValueError(f"sequence length {pos_emb.shape[seq_dim]} is not divisible by 2*cp={2 * cp_size}")
    chunks = pos_emb.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=seq_dim)


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    """Within the block ``Tensor.cuda()`` returns the tensor itself (CPU-only host)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _cuda_method_is_identity(fn: Callable) -> Callable:
    """Wrap ``fn`` so that its ``tensor.cuda()`` calls keep tensors on the CPU."""

    def wrapper(*args, **kwargs):
        with _tensor_cuda_is_identity():
            return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "wrapper")
    wrapper.__doc__ = fn.__doc__
    wrapper.__wrapped__ = fn
    return wrapper


def _make_norm_new(original_new: Callable) -> Callable:
    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                normalization="LayerNorm"):
        """``WrappedTorchNorm`` that accepts sequence parallelism.

        Under SP each TP rank normalises its own sequence shard with replicated weights, so the
        norm's weight gradients are partial sums over the sequence. TE/Apex norms mark their
        parameters ``sequence_parallel=True`` so that ``finalize_model_grads`` all-reduces them
        over TP; the torch norm just asserts SP is off. We build it with SP hidden from the
        assertion and mark the parameters the same way.
        """
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        hidden = copy.copy(config)  # shallow: only the assertion reads the flag
        object.__setattr__(hidden, "sequence_parallel", False)
        norm = original_new(cls, hidden, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return __new__


def _move_to_host_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` that also honours ``as_numpy`` for CPU tensors."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().cpu().numpy()
    return tensor


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """``clip_grad_by_total_norm_fp32`` for CPU tensors: same rule (scale every grad by
    max_norm / (total_norm + 1e-6) when that is below 1), without the CUDA-only assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            grad.detach().mul_(clip_coeff)


# ----------------------------------------------------------------------------------------------
# enable / disable
# ----------------------------------------------------------------------------------------------
def enable(*, kernels: bool = False) -> bool:
    """Apply the CPU shims to Megatron-Core (idempotent).

    ``kernels=True`` also installs torch stand-ins for the GPU kernels used by Megatron's stock
    ``GatedDeltaNet`` (FLA) and ``MambaMixer`` (mamba-ssm, Triton inference ops); see
    :mod:`megatron_tree.cpu.standins`.

    Returns False without touching anything when CUDA is available; True when the shims are
    active. ``megatron.core`` modules imported later are patched on import (a meta-path hook);
    a second call rescans ``sys.modules`` as well. With ``kernels=True``, call it before importing
    ``megatron.core.ssm.mamba_mixer`` (that module imports Triton ops at import time).
    Requirements left to the caller: ``use_cpu_initialization=True`` is the tested way to build
    models; pipeline configs should set ``pipeline_dtype``; the gloo process group is the
    caller's (see ``tests/dist.py``).
    """
    global _ENABLED, _KERNELS
    if torch.cuda.is_available():
        return False
    with _LOCK:
        for name in _CORE_MODULES:
            importlib.import_module(name)
        if kernels:
            from megatron_tree.cpu import standins  # noqa: PLC0415 (imports Megatron SSM modules)

            standins.prepare_imports(_set)
        _ENABLED = True
        _apply_core()
        if kernels and not _KERNELS:
            standins.install(_set)
            _KERNELS = True
        _patch_loaded_megatron_modules()
        if _IMPORT_HOOK not in sys.meta_path:
            sys.meta_path.insert(0, _IMPORT_HOOK)
    return True


def _copy_storage(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Megatron's ``share_storage(dst, src)`` by copy: ``dst``'s storage (emptied when its output was
    discarded) takes ``src``'s bytes, so every view of ``dst`` sees the recomputed values."""
    ds, ss = dst.untyped_storage(), src.untyped_storage()
    if ds.nbytes() != ss.nbytes():
        ds.resize_(ss.nbytes())
    ds.copy_(ss)


def _share_storage_by_copy():
    """CPU stand-in of ``tensor_parallel.random._get_share_storage`` (returns the share function)."""
    return _copy_storage


def _reduce_skipping_a_group_of_one(original):
    """``reduce_from_tensor_model_parallel_region`` that returns its input itself for a group of one (the
    Function's forward and backward are both the identity there)."""
    def reduce_from_tensor_model_parallel_region(input_, group=None):
        from megatron.core.tensor_parallel.mappings import get_tensor_model_parallel_group_if_none

        if get_tensor_model_parallel_group_if_none(group).size() == 1:
            return input_
        return original(input_, group=group)

    reduce_from_tensor_model_parallel_region.__wrapped__ = original
    return reduce_from_tensor_model_parallel_region


def _apply_core() -> None:
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding
    from megatron.core.models.common.language_module import language_module
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import data as tp_data, random as tp_random
    from megatron.core.transformer import torch_norm

    why_rng = "RNG streams live in the CPU default generator (no CUDA generator on this host)"
    _set(tp_random, "_get_cuda_rng_state", _get_rng_state_cpu, why_rng)
    _set(tp_random, "_set_cuda_rng_state", _set_rng_state_cpu, why_rng)
    _set(tp_random.CudaRNGStatesTracker, "add", _tracker_add, why_rng)
    _set(tp_random.CudaRNGStatesTracker, "fork", _make_tracker_fork(tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME),
         why_rng + "; no 'CPU RNG changed' warning")
    # model_parallel_cuda_manual_seed calls torch.cuda.manual_seed, which the CPU view of torch
    # in tensor_parallel.random maps to torch.manual_seed (patched by _patch_module below).
    _patch_module(tp_random)
    if hasattr(tp_random, "_get_share_storage"):  # megatron-core 0.19's output-discarding recomputation
        _set(tp_random, "_get_share_storage", _share_storage_by_copy,
             "its zero-copy share is a C++ extension JIT-compiled on first use (20-50 s on a 2-core host, and a "
             "process killed while compiling leaves a lock that every later compile waits on forever); on the "
             "CPU the recomputed output is copied into the discarded output's storage")

    why_rope = "pin_memory + .cuda() replaced by an index on pos_emb's own device"
    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        if hasattr(module, "get_pos_emb_on_this_cp_rank"):
            _set(module, "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank, why_rope)

    from megatron.core.tensor_parallel import layers as tp_layers

    _set(tp_layers, "reduce_from_tensor_model_parallel_region",
         _reduce_skipping_a_group_of_one(tp_layers.reduce_from_tensor_model_parallel_region),
         "at TP 1 the reduce is the identity; as the autograd Function it returns its input as its output, and "
         "the local experts with biases (gpt-oss's) add the bias to that output in place (MLP.forward, "
         "per_token_scale), which autograd forbids on a custom Function's output (TE's grouped experts, the GPU "
         "path, never take it)")

    why_cuda = "tensor.cuda() inside keeps tensors on the CPU"
    lm = language_module.LanguageModule
    _set(lm, "setup_embeddings_and_output_layer", _cuda_method_is_identity(lm.setup_embeddings_and_output_layer),
         why_cuda + " (tied-embedding sync between first and last PP stage)")
    wrapped_broadcast = _cuda_method_is_identity(tp_data.broadcast_data)
    _set(tp_data, "broadcast_data", wrapped_broadcast, why_cuda)
    if getattr(tensor_parallel, "broadcast_data", None) is wrapped_broadcast.__wrapped__:
        _set(tensor_parallel, "broadcast_data", wrapped_broadcast, why_cuda)

    from megatron.core.optimizer import clip_grads, optimizer as mopt

    why_clip = "the CUDA grad-type assertion and CUDA overflow buffer replaced by an in-place CPU scale"
    _set(clip_grads, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_cpu, why_clip)
    if getattr(mopt, "clip_grad_by_total_norm_fp32", None) is not None:
        _set(mopt, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_cpu, why_clip)

    from megatron.core.transformer.moe import moe_utils

    from megatron.core.transformer.moe import token_dispatcher

    _set(token_dispatcher, "maybe_move_tensor_to_cpu", _move_to_host_cpu,
         "split sizes must become host lists for all-to-all even when the tensors already live on the CPU")
    if not hasattr(moe_utils, "te_general_gemm"):
        _set(moe_utils, "te_general_gemm", None,
             "Megatron 0.16.1 reads te_general_gemm in the router GEMM but defines it only when TE imports")

    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer import multi_latent_attention as mla

    if not te_ext.HAVE_TE and getattr(mla, "HAVE_TE", False):
        # Without TE, Megatron's TE wrappers are MagicMocks and MultiLatentAttention.__init__ raises in
        # isinstance(linear_proj, TELinear); with the flag down it skips its TE-only (fp8) branches
        _set(mla, "HAVE_TE", False, "transformer-engine is not installed: MLA's TE-only branches are skipped")

    norm_cls = torch_norm.WrappedTorchNorm
    _set(norm_cls, "__new__", _make_norm_new(norm_cls.__new__),
         "accept sequence_parallel; mark params sequence_parallel=True so grads are all-reduced over TP")


def disable() -> None:
    """Undo every patch of :func:`enable` (most recent first). Stand-in modules placed in
    ``sys.modules`` are removed too; Megatron modules imported meanwhile stay imported."""
    global _ENABLED, _KERNELS
    with _LOCK:
        if _IMPORT_HOOK in sys.meta_path:
            sys.meta_path.remove(_IMPORT_HOOK)
        while _PATCHES:
            p = _PATCHES.pop()
            if isinstance(p.target, dict):
                if p.had_attr:
                    p.target[p.name] = p.original
                else:
                    p.target.pop(p.name, None)
            elif p.had_attr:
                setattr(p.target, p.name, p.original)
            else:
                try:
                    delattr(p.target, p.name)
                except AttributeError:
                    pass
        _PATCHED_KEYS.clear()
        _ENABLED = False
        _KERNELS = False
