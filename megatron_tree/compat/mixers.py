"""Megatron-Core's stock sequence-mixer API across the supported versions (0.16.1 and 0.19.x).

Two differences matter to the tree mixers, which subclass the stock modules:

* **Where Gated DeltaNet lives.** 0.16.1 has one module, ``megatron.core.ssm.gated_delta_net``,
  holding ``GatedDeltaNet``, ``HAVE_FLA``, ``chunk_gated_delta_rule`` and ``l2norm``. 0.19.x turns
  it into a package: the package re-exports those names, but the constructor reads ``HAVE_FLA``
  and the forward calls the FLA functions from ``gated_delta_net.common`` /
  ``gated_delta_net.gdn``. A flag flipped or a function replaced on the package alone changes
  nothing there. :func:`gdn_modules` lists every loaded module that binds those names, so a
  caller sets them everywhere they are read.
* **Constructor keywords.** 0.19.x spec builders pass ``name=`` (the module's dotted instance
  name) to every mixer and attention module; 0.16.1's stock constructors do not accept it.
  :func:`stock_kwargs` keeps only the keywords the stock constructor takes, so a tree module
  accepts ``name`` on every version and forwards it where the stock module knows it.
* **Mamba conv parameters.** 0.16.1's ``MambaMixer`` holds an ``nn.Conv1d`` (parameters
  ``conv1d.weight`` / ``conv1d.bias``); 0.19.x holds them directly as ``conv1d_weight`` /
  ``conv1d_bias`` and maps them back to the old keys in ``sharded_state_dict``, so checkpoints
  are unchanged. :func:`checkpoint_param_name` gives the version-independent (checkpoint) name of a
  parameter, :func:`mamba_conv_params` the conv weight and bias of either layout.

Feature checks, not version checks: each helper looks at what the installed Megatron-Core has.
Nothing is patched on import.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from typing import Any, Callable, Iterator

__all__ = ["GDN_PACKAGE", "gdn_modules", "fla_check_bypassed", "stock_kwargs", "checkpoint_param_name",
           "mamba_conv_params", "megatron_core_version"]

GDN_PACKAGE = "megatron.core.ssm.gated_delta_net"
# 0.19.x submodules of the GDN package that read HAVE_FLA / call the FLA functions (in this order).
_GDN_SUBMODULES = ("common", "gdn")
_FLA_NAMES = ("HAVE_FLA", "chunk_gated_delta_rule", "l2norm")


def gdn_modules() -> list:
    """The stock GDN module (0.16.1) or the package and its submodules that bind ``HAVE_FLA`` /
    ``chunk_gated_delta_rule`` / ``l2norm`` (0.19.x), imported, package first."""
    package = importlib.import_module(GDN_PACKAGE)
    modules = [package]
    if hasattr(package, "__path__"):  # a package (0.19.x)
        for sub in _GDN_SUBMODULES:
            name = f"{GDN_PACKAGE}.{sub}"
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            if any(n in vars(module) for n in _FLA_NAMES):
                modules.append(module)
    return modules


@contextlib.contextmanager
def fla_check_bypassed() -> Iterator[None]:
    """Within the block, every stock GDN module reads ``HAVE_FLA = True``.

    The stock ``GatedDeltaNet.__init__`` raises ImportError without FLA although building the
    module needs nothing from it; the tree module never reaches the stock FLA call. 0.19.x also
    stores the kernel function at construction and asserts it is set: a placeholder that raises
    if called stands in for a missing one. Everything is restored on exit."""
    saved = []
    for module in gdn_modules():
        names = vars(module)
        if "HAVE_FLA" in names:
            saved.append((module, "HAVE_FLA", names["HAVE_FLA"]))
            module.HAVE_FLA = True
        # 0.19.x: the constructor stores the kernel (None without FLA) and asserts it is set.
        if "chunk_gated_delta_rule" in names and names["chunk_gated_delta_rule"] is None:
            saved.append((module, "chunk_gated_delta_rule", None))
            module.chunk_gated_delta_rule = _fla_not_installed
    try:
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


def _fla_not_installed(*args: Any, **kwargs: Any):
    """Stored as the stock kernel by a GDN module built without FLA; the tree modules never call it."""
    raise ImportError("FLA's chunk_gated_delta_rule is not installed (the stock GatedDeltaNet forward needs it; "
                      "the tree modules use megatron_tree.ops.tree_gated_delta_rule instead)")


def _accepted(fn: Callable) -> tuple[set, bool]:
    params = inspect.signature(fn).parameters.values()
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def stock_kwargs(fn: Callable, **kwargs: Any) -> dict:
    """``kwargs`` restricted to those ``fn`` (a stock constructor) accepts, dropping ``None``
    values it does not know. A non-``None`` value ``fn`` does not accept raises TypeError, as a
    direct call would, except ``name`` (an instance label only: 0.16.1 has no place for it)."""
    names, var_kw = _accepted(fn)
    out = {}
    for key, value in kwargs.items():
        if var_kw or key in names:
            out[key] = value
        elif value is not None and key != "name":
            raise TypeError(f"{getattr(fn, '__qualname__', fn)}() got an unexpected keyword argument {key!r} "
                            f"(megatron-core {megatron_core_version()})")
    return out


# 0.19.x MambaMixer parameter -> its (0.16.1-compatible) checkpoint name.
_MAMBA_CHECKPOINT_NAMES = {"conv1d_weight": "conv1d.weight", "conv1d_bias": "conv1d.bias"}


def checkpoint_param_name(name: str) -> str:
    """The checkpoint name of parameter ``name`` (a ``named_parameters`` key, any prefix): the same
    on every supported version (0.19.x ``...conv1d_weight`` -> ``...conv1d.weight``)."""
    head, dot, last = name.rpartition(".")
    return f"{head}{dot}{_MAMBA_CHECKPOINT_NAMES.get(last, last)}"


def mamba_conv_params(mixer) -> tuple:
    """``(weight [C, 1, W], bias [C] or None)`` of a (Tree)MambaMixer's depthwise conv, either layout."""
    if hasattr(mixer, "conv1d_weight"):  # 0.19.x
        return mixer.conv1d_weight, getattr(mixer, "conv1d_bias", None)
    return mixer.conv1d.weight, mixer.conv1d.bias  # 0.16.1


def megatron_core_version() -> str:
    """The installed megatron-core version string ("unknown" when it cannot be read)."""
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # noqa: BLE001 (a source checkout without metadata)
        module = sys.modules.get("megatron.core") or importlib.import_module("megatron.core")
        return str(getattr(module, "__version__", "unknown"))
