"""Version shims (`megatron_tree.compat.mixers`): what differs between megatron-core 0.16.1 and 0.19.x
and broke us on the latest release. Runs on both tiers; each test holds on either version."""
from __future__ import annotations

import inspect

import pytest
import torch

from megatron_tree.cpu import megatron_core as cpu_layer
from megatron_tree.compat.mixers import checkpoint_param_name, gdn_modules, stock_kwargs

from dist import init_megatron  # noqa: F401  (tests/dist.py)


def test_stock_kwargs_forwards_name_only_where_the_stock_constructor_takes_it():
    def old(config, submodules, layer_number=None, pg_collection=None):  # 0.16.1-like
        pass

    def new(config, submodules, layer_number=None, pg_collection=None, *, name=None, cp_comm_type=None):  # 0.19
        pass

    assert stock_kwargs(old, name="decoder.layers.0.mixer") == {}
    assert stock_kwargs(new, name="decoder.layers.0.mixer") == {"name": "decoder.layers.0.mixer"}
    assert stock_kwargs(old, name=None, other=None) == {}
    with pytest.raises(TypeError, match="unexpected keyword argument 'other'"):
        stock_kwargs(old, other=3)


def test_checkpoint_param_names_are_version_independent():
    assert checkpoint_param_name("decoder.layers.0.mixer.conv1d_weight") == "decoder.layers.0.mixer.conv1d.weight"
    assert checkpoint_param_name("conv1d_bias") == "conv1d.bias"
    assert checkpoint_param_name("conv1d.weight") == "conv1d.weight"
    assert checkpoint_param_name("in_proj.weight") == "in_proj.weight"


def test_tree_modules_accept_the_name_keyword():
    """0.19 spec builders pass name= to every mixer (the hybrid stacks failed to build on 0.19.2:
    "TreeGatedDeltaNet.__init__() got an unexpected keyword argument 'name'")."""
    from megatron_tree.megatron.attention import TreeDotProductAttention
    from megatron_tree.megatron.gdn import TreeGatedDeltaNet

    for cls in (TreeGatedDeltaNet, TreeDotProductAttention):
        assert "name" in inspect.signature(cls.__init__).parameters, cls


def _build_named_mixers():
    """On one rank: a tree GDN / Mamba / attention module built with name=, as 0.19 builders do."""
    from megatron_tree.megatron.attention import TreeDotProductAttention
    from megatron_tree.megatron.gdn import tree_gdn_module_spec
    from megatron_tree.megatron.mamba import tree_mamba_module_spec
    from megatron_tree.training.models import ModelArgs, make_config
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.core.transformer.spec_utils import build_module

    init_megatron(tp=1, kernels=True)
    cfg = make_config(ModelArgs(kind="hybrid", pattern="MG*-", hidden_size=32), dtype=torch.float32)
    out = {}
    # build_module with name= is exactly what 0.19's spec builders do
    out["gdn"] = type(build_module(tree_gdn_module_spec(), config=cfg, layer_number=1,
                                   name="decoder.layers.0.self_attention"))
    out["mamba"] = type(build_module(tree_mamba_module_spec(), config=cfg, layer_number=1,
                                     name="decoder.layers.1.mixer"))
    out["attention"] = type(TreeDotProductAttention(cfg, 1, AttnMaskType.causal, "self",
                                                    name="decoder.layers.2.self_attention.core_attention"))
    # the FLA flag is restored wherever the stock constructor reads it
    out["fla_flags"] = sorted({bool(m.HAVE_FLA) for m in gdn_modules() if "HAVE_FLA" in vars(m)})
    return {k: (v.__name__ if isinstance(v, type) else v) for k, v in out.items()}


def test_tree_mixers_build_with_name(megatron_tp1_named):
    assert megatron_tp1_named["gdn"] == "TreeGatedDeltaNet"
    assert megatron_tp1_named["mamba"] == "TreeMambaMixer"
    assert megatron_tp1_named["attention"] == "TreeDotProductAttention"
    assert megatron_tp1_named["fla_flags"] == [True]  # stand-ins installed everywhere the flag is read


@pytest.fixture(scope="module")
def megatron_tp1_named():
    from megatron_tree.training.launch import run_distributed

    return run_distributed(_build_named_mixers, 1, timeout=240)[0]


def test_gdn_modules_cover_where_the_fla_names_are_read():
    mods = gdn_modules()
    assert mods[0].__name__ == "megatron.core.ssm.gated_delta_net"
    if hasattr(mods[0], "__path__"):  # 0.19.x: the package and the submodules that read the names
        names = {m.__name__ for m in mods}
        assert "megatron.core.ssm.gated_delta_net.common" in names
    assert cpu_layer is not None


_RESTART_WORKER = '''
import os, signal, sys, time
import torch, torch.distributed as dist
if sys.argv[1] == "shim":
    from megatron_tree.compat.torchelastic import isolate_restart_attempts
    isolate_restart_attempts()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 1 and os.environ["RANK"] == "1":
    time.sleep(6)  # the peer arrives late: rank 0 reads whatever address the store holds for it
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
if attempt == 0 and dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # a rank dies: torchrun restarts both
dist.all_reduce(t)
print(f"attempt {attempt} rank {dist.get_rank()} done", flush=True)
# leaving with a live gloo group aborts at interpreter exit now and then ("terminate called without an
# active exception", SIGABRT after both ranks printed done): close it the way a finished job does
dist.barrier()
dist.destroy_process_group()
'''


def test_restart_attempts_get_their_own_store_keys(monkeypatch):
    """With the shim, an ``env://`` store under torchrun's agent store is prefixed by the restart attempt:
    a key set by attempt 1 lands under ``/worker/attempt_1/`` of the agent's store, where attempt 0's keys
    (the peers' addresses of a dead attempt) cannot be read."""
    import datetime
    import importlib

    import torch.distributed as dist

    from megatron_tree.compat import torchelastic

    rdzv = importlib.import_module("torch.distributed.rendezvous")
    monkeypatch.setattr(rdzv, "_create_c10d_store", rdzv._create_c10d_store)  # the shim's patch is undone after
    agent = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    port = agent.port
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert torchelastic.isolate_restart_attempts() or torchelastic._prefixes_attempts(rdzv._create_c10d_store)
    store = rdzv._create_c10d_store("127.0.0.1", port, 0, 1, datetime.timedelta(seconds=30))
    store.set("rank_1", "attempt one")
    assert agent.get("/worker/attempt_1/rank_1") == b"attempt one"
    assert not agent.check(["rank_1"])


def test_torchrun_restart_attempts_do_not_read_the_previous_attempts_keys(tmp_path):
    """torchrun --max-restarts 1, rank 1 killed in attempt 0 and late in attempt 1: with
    `compat.torchelastic.isolate_restart_attempts` both ranks of attempt 1 meet and finish. (Without it
    torch 2.13 reuses the agent's store bare and rank 0 may read rank 1's dead address of attempt 0:
    a race, so only the prefix itself is checked exactly, above.)"""
    import subprocess
    import sys

    script = tmp_path / "w.py"
    script.write_text(_RESTART_WORKER)

    def run(mode):
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "--max-restarts", "1", str(script), mode], capture_output=True, text=True, timeout=300)

    shim = run("shim")
    assert shim.returncode == 0 and "attempt 1 rank 0 done" in shim.stdout, shim.stderr[-3000:]
    assert "attempt 1 rank 1 done" in shim.stdout
