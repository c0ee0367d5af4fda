"""Megatron-LM's ``megatron.training`` (``pretrain()``) on a CPU-only host with gloo.

Serves the ``megatron.training`` of Megatron-LM tag core_v0.16.1 (a checkout) and of the
megatron-core 0.19.x wheels. It sits on top of :mod:`megatron_tree.cpu.megatron_core` (Megatron-Core on
CPU, with the kernel stand-ins), which :func:`enable` applies first. What ``megatron.training``
adds on a host without CUDA, and what each shim does about it:

* ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless ``allow_no_cuda=True``,
  which ``pretrain`` never passes: the wrapper passes it.
* ``_initialize_distributed`` and ``_set_random_seed`` skip model-parallel initialisation and the
  model-parallel RNG seeding when ``torch.cuda.device_count() == 0``: the ``initialize`` module
  sees one "device" (its ``set_device`` does nothing), and the default process group is created
  with gloo before Megatron-LM's own call (which then takes its "already initialized" branch).
* ``get_model`` moves every model chunk with ``module.cuda(torch.cuda.current_device())``: inside
  it ``Tensor.cuda()`` keeps tensors where they are.
* Every other ``megatron.training`` module that places tensors with ``device='cuda'`` or calls
  ``torch.cuda.*`` (timers, loss reduction, memory reports, RNG state in checkpoints) gets a
  private CPU view of ``torch`` (the one of ``cpu.megatron_core``, plus zero memory statistics), never
  the global ``torch``.
* Random numbers: on a GPU, ``torch.rand(..., device="cuda")`` and dropout on CUDA tensors draw from
  the CUDA generator, while ``--use-cpu-initialization`` builds the full weights from the CPU
  generator and splits them, so a seed gives the same model under any CP size, and under any TP
  size too except for the TP shards Megatron-Core draws per rank from the model-parallel RNG stream
  (Mamba-2 / GDN ``conv1d``, ``dt_bias``, ``A_log``: TP-dependent on GPUs as well). Here both
  would be the CPU generator: ``pretrain()``'s JIT warm-up (``_warmup_jit_function``: random inputs
  of ``seq_length / CP x ffn_hidden_size / TP`` elements, then dropout on them) ran between the
  seeding and the model's construction, so the initial weights depended on CP and TP. The warm-up
  runs under ``torch.random.fork_rng`` (the CPU state is restored), and every ``device="cuda"``
  draw of a ``megatron.training`` module (``rand``, ``randn``, ``randint``, ``randperm``,
  ``normal``) comes from a stand-in CUDA generator that their ``torch.manual_seed`` seeds too.
* ``validate_args`` reads the GPU architecture (``get_device_properties``: architecture 0 here)
  and then, with TP or CP > 1, asserts ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (meaningless on a CPU);
  the launcher sets it (:data:`CPU_ENV`).
* Fused-kernel builds and TE: the launcher adds the non-TE CPU flags of :data:`CPU_FLAGS`
  (``--transformer-impl local``, the ``--no-*-fusion`` switches, ``--use-cpu-initialization``,
  ``--distributed-backend gloo``) unless the command line already sets them.

Nothing happens on import; :func:`enable` is explicit, idempotent, returns False on a CUDA host
(the real code runs there) and records every change in ``megatron_tree.cpu.megatron_core.applied()``.
"""
from __future__ import annotations

import datetime
import functools
import importlib
import os
import re
import sys
from typing import Any, Callable, Sequence

import torch

from megatron_tree.cpu import megatron_core as _cpu

__all__ = ["CPU_FLAGS", "CPU_ENV", "add_cpu_flags", "enable", "is_enabled"]

#: Megatron-LM flags a CPU run needs, as (flag, value or None, flags that count as "already set").
#: No transformer-engine, no CUDA-fused kernels, weights built on the CPU, gloo collectives.
CPU_FLAGS: tuple[tuple[str, Any, tuple[str, ...]], ...] = (
    ("--transformer-impl", "local", ()),
    ("--no-rope-fusion", None, ("--rope-fusion",)),
    ("--no-gradient-accumulation-fusion", None, ("--gradient-accumulation-fusion",)),
    ("--no-masked-softmax-fusion", None, ("--masked-softmax-fusion",)),
    ("--no-bias-swiglu-fusion", None, ("--bias-swiglu-fusion",)),
    ("--no-bias-dropout-fusion", None, ("--bias-dropout-fusion",)),
    ("--no-persist-layer-norm", None, ("--persist-layer-norm",)),
    ("--use-cpu-initialization", None, ()),
    ("--distributed-backend", "gloo", ()),
)

#: Environment a CPU run needs (set unless already set): Megatron-LM asserts it with TP/CP > 1.
CPU_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}

_ENABLED = False


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def add_cpu_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` plus every flag of :data:`CPU_FLAGS` it does not set itself (nor its opposite)."""
    out = list(argv)
    for flag, value, opposites in CPU_FLAGS:
        if _given(argv, flag) or any(_given(argv, o) for o in opposites):
            continue
        out += [flag] if value is None else [flag, str(value)]
    return out


def is_enabled() -> bool:
    """True while the layer is applied (``cpu.disable()`` undoes it with the rest)."""
    return _ENABLED and _cpu.is_enabled()


# ----------------------------------------------------------------------------------------------
# torch as seen by megatron.training modules
# ----------------------------------------------------------------------------------------------
class _TrainingCpuCuda(_cpu._CpuCuda):
    """``cpu.megatron_core``'s CPU ``torch.cuda`` plus what ``megatron.training`` reads: one "device"
    (so model-parallel groups and RNG streams get initialised), a no-op ``set_device`` and zero
    memory statistics. ``is_available()`` stays False, so code that asks takes its CPU branch."""

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated

    @staticmethod
    def memory_stats(device: Any = None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    reset_max_memory_allocated = reset_peak_memory_stats

    @staticmethod
    def get_device_properties(device: Any = None) -> "_CpuDeviceProperties":
        return _CpuDeviceProperties()


class _CpuDeviceProperties:
    """What ``get_device_arch_version()`` & co. read: architecture 0 (no Blackwell-only paths)."""

    name = "cpu"
    major = 0
    minor = 0
    multi_processor_count = 1
    total_memory = 0


#: Stand-in for the CUDA default generator behind the random tensor factories of
#: ``megatron.training`` modules: on a GPU, ``torch.rand(..., device="cuda")`` draws from the CUDA
#: generator, never from the CPU one that ``--use-cpu-initialization`` builds the weights from.
#: Seeded with every ``torch.manual_seed`` those modules make (as torch seeds the CUDA generators).
_CUDA_STANDIN = torch.Generator()
_RANDOM_FACTORIES = ("rand", "randn", "randint", "randperm", "normal")


def _cuda_draws_on_standin(factory: Callable) -> Callable:
    """``factory`` (a torch random factory) with ``device='cuda'`` draws taken from
    :data:`_CUDA_STANDIN` (unless the call names its own generator) and placed on the CPU."""
    placed = _cpu._on_cpu(factory)

    @functools.wraps(factory)
    def draw(*args, **kwargs):
        device = kwargs.get("device")
        if kwargs.get("generator") is None and device is not None and _cpu._cpu_device(device) is not device:
            kwargs["generator"] = _CUDA_STANDIN
        return placed(*args, **kwargs)

    draw.__doc__ = (f"torch.{factory.__name__} for megatron.training on a CPU host: device='cuda' draws come "
                    "from the CUDA stand-in generator, not the CPU default one (megatron_tree.cpu.megatron_training)")
    return draw


def _manual_seed(seed: int) -> Any:
    """``torch.manual_seed`` that also seeds the CUDA stand-in (torch seeds every CUDA device too)."""
    _CUDA_STANDIN.manual_seed(int(seed))
    return torch.manual_seed(seed)


class _TrainingCpuTorch(_cpu._CpuTorch):
    cuda = _TrainingCpuCuda()
    manual_seed = staticmethod(_manual_seed)

    def __repr__(self) -> str:
        return "<torch (CPU view for megatron.training, megatron_tree.cpu.megatron_training)>"


for _name in _RANDOM_FACTORIES:
    setattr(_TrainingCpuTorch, _name, staticmethod(_cuda_draws_on_standin(getattr(torch, _name))))


_TRAINING_TORCH = _TrainingCpuTorch()
_CALL_SITE = re.compile(r"torch\.cuda\.|device\s*=\s*['\"]cuda|\.cuda\(")


def _patch_training_module(module: Any) -> bool:
    return _cpu._patch_module(
        module, _TRAINING_TORCH, _CALL_SITE,
        "megatron.training: module-level torch -> CPU view (device='cuda' -> CPU, one device, no-op "
        "synchronize/set_device, zero memory statistics)")


# ----------------------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------------------
def _allow_no_cuda(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return fn(*args, **kwargs)

    initialize_megatron.__doc__ = ("initialize_megatron with allow_no_cuda=True (megatron_tree.cpu.megatron_training; "
                                   "pretrain() never passes it)")
    return initialize_megatron


def _gloo_first(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def _initialize_distributed(*args, **kwargs):
        """Create the default process group with gloo (from torchrun's environment), then run
        Megatron-LM's own initialisation, which finds it initialised."""
        import torch.distributed as dist

        if not dist.is_initialized():
            from megatron.training import get_args

            margs = get_args()
            minutes = getattr(margs, "distributed_timeout_minutes", None) or 10
            dist.init_process_group("gloo", rank=int(os.environ.get("RANK", "0")),
                                    world_size=int(os.environ.get("WORLD_SIZE", "1")),
                                    timeout=datetime.timedelta(minutes=minutes))
        return fn(*args, **kwargs)

    return _initialize_distributed


def _warmup_keeps_cpu_rng(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def _warmup_jit_function(*args, **kwargs):
        # Its dropout runs on CPU tensors here, i.e. on the CPU default generator, by an amount that
        # depends on --seq-length / CP and --ffn-hidden-size / TP: without the restore the weights
        # --use-cpu-initialization draws next would depend on the CP and TP sizes.
        with torch.random.fork_rng(devices=[]):
            return fn(*args, **kwargs)

    _warmup_jit_function.__doc__ = ("Megatron-LM's JIT warm-up with the CPU RNG state restored afterwards "
                                    "(megatron_tree.cpu.megatron_training)")
    return _warmup_jit_function


def _replace_everywhere(name: str, original: Any, replacement: Any, why: str) -> None:
    """Point every loaded megatron.training module that binds ``name`` to ``original`` at ``replacement``."""
    for mod_name, module in list(sys.modules.items()):
        if module is None or not (mod_name == "megatron.training" or mod_name.startswith("megatron.training.")):
            continue
        if vars(module).get(name) is original:
            _cpu._set(module, name, replacement, why)


# ----------------------------------------------------------------------------------------------
# enable
# ----------------------------------------------------------------------------------------------
def enable() -> bool:
    """Apply the CPU layer for ``megatron.training`` (and ``cpu.enable(kernels=True)``).

    Call it before ``pretrain()``. Returns False on a CUDA host (nothing changes), True otherwise.
    Raises ImportError when ``megatron.training`` does not import (message from
    ``compat.lm_api.MISSING_MEGATRON_TRAINING``)."""
    global _ENABLED
    if torch.cuda.is_available():
        return False
    if _ENABLED and _cpu.is_enabled():
        return True
    _cpu.enable(kernels=True)
    try:
        training = importlib.import_module("megatron.training")
        importlib.import_module("megatron.training.training")
        init = importlib.import_module("megatron.training.initialize")
    except ImportError as exc:
        from megatron_tree.compat.lm_api import MISSING_MEGATRON_TRAINING

        raise ImportError(f"{MISSING_MEGATRON_TRAINING} ({exc})") from exc
    for mod_name, module in list(sys.modules.items()):
        if module is not None and (mod_name == "megatron.training" or mod_name.startswith("megatron.training.")):
            _patch_training_module(module)
    _cpu._patch_loaded_megatron_modules()  # megatron.core modules megatron.training imported

    original_init = init.initialize_megatron
    _replace_everywhere("initialize_megatron", original_init, _allow_no_cuda(original_init),
                        "initialize_megatron(allow_no_cuda=True): Megatron-LM asserts CUDA otherwise")
    _cpu._set(init, "_initialize_distributed", _gloo_first(init._initialize_distributed),
              "the default process group is created with gloo before Megatron-LM's initialisation")
    if hasattr(init, "_warmup_jit_function"):  # both supported versions have it; guard a rename
        _cpu._set(init, "_warmup_jit_function", _warmup_keeps_cpu_rng(init._warmup_jit_function),
                  "_warmup_jit_function under torch.random.fork_rng: its random inputs and dropout must not "
                  "move the CPU generator the weights are initialised from")
    tr = importlib.import_module("megatron.training.training")
    original_get_model = tr.get_model
    _replace_everywhere("get_model", original_get_model, _cpu._cuda_method_is_identity(original_get_model),
                        "get_model: module.cuda() keeps the model on the CPU")
    _ENABLED = training is not None
    return True
