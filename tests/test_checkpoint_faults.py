"""Checkpoints that cannot be half-read: a `megatron-tree train` save that fails or is killed never
becomes the checkpoint ``latest`` names, every rank stops with one clear error, and the run resumes
from the previous checkpoint exactly.

One spawn of 2 gloo ranks (TP 2, so that both ranks write tensor files) runs a hybrid (Mamba-2,
Gated DeltaNet, attention and MLP layers) whose save of step 4 gets ENOSPC from a tensor write on
rank 1 only (injected in dist_checkpointing's writer) as a job under torchrun, what torchrun's
restart of that job does (it refuses to train again: the save's marker), and the resume of that
run. Then a GPT run whose ranks are SIGKILLed inside dist_checkpointing.save of step 4 (tensor
files written, metadata not), and its resume.
Where this process may mount a small tmpfs (root), the real thing through the command line (the
hybrid): the filesystem fills up during the save of step 4, and a run loading what is left resumes.
The oracle is the uninterrupted run: CPU float32 training is deterministic, so every resumed step's
loss, gradient norm, learning rate and samples are equal. The failing run itself is that run: it
trains steps 1 to 4 without a stop (only the save after step 4 fails or is killed), and its
``--metrics-jsonl`` keeps them. Runs in both tiers: how dist_checkpointing
reports a writer's failure differs between Megatron-Core 0.16 and 0.19.
"""
from __future__ import annotations

import errno
import functools
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from megatron_tree.training.checkpoint_errors import (FAILED_SAVE_MARKER, CheckpointSaveError,
                                                      refuse_restart_after_failed_save)
from megatron_tree.training.launch import DistributedError, run_distributed
from megatron_tree.training.trainer import PARTIAL_SUFFIX, build_train_parser, latest_checkpoint

from test_preemption import _argv, _run_cli, _same_steps, _write_data

STEPS, SAVE_EVERY = 4, 2
#: 2 ranks as TP 2 (DP 1): each rank writes its own tensor shards, so a failure on rank 1 is a
#: failure of rank 1's writes (under DP 2 rank 0 writes every replicated tensor)
LAYOUT = ("--tensor-model-parallel-size", "2", "--train-iters", STEPS)
#: the ENOSPC case's model: our hybrid stack with a Mamba-2, a Gated DeltaNet, an attention and an MLP layer
HYBRID = ("--hybrid-override-pattern", "MG*-", "--num-layers", "4")
#: what torchrun gives its workers: the job's rendezvous run id, the restart attempt
TORCHRUN_JOB = {"TORCHELASTIC_RUN_ID": "ckpt-faults-job", "TORCHELASTIC_RESTART_COUNT": "0"}


def _args(data, *extra):
    return build_train_parser().parse_args(_argv(data, "--quiet", *LAYOUT, *extra))


def _on_save_of(step: int, action) -> None:
    """In this rank: ``action(stream)`` replaces dist_checkpointing's tensor writes into the
    checkpoint of ``step`` (its writers are threads of this process or processes forked from it, so
    they see the replacement); the writes of other checkpoints go through."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    real = filesystem_async._write_item

    @functools.wraps(real)  # the writer reads its signature
    def write_item(*args, **kwargs):
        stream = next(a for a in args if hasattr(a, "write") and isinstance(getattr(a, "name", None), str))
        if f"iter_{step:07d}" in stream.name:
            return action(stream)
        return real(*args, **kwargs)

    filesystem_async._write_item = write_item


def _no_space(stream):
    stream.write(b"\0" * 512)  # some bytes made it, as on a filling disk
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), stream.name)


def _enospc_body(data, root):
    """The hybrid with ENOSPC on rank 1's tensor write of step 4, under a torchrun job's environment
    (every rank reports the error, and what it saw of the directory right after; rank 0 keeps every
    step in ``root/steps.jsonl``); torchrun's restart of that job (`trainer.run` raises the save's
    error before it reads anything) and a job with another run id (nothing refused); the resume of
    that run from step 2."""
    import torch.distributed as dist

    from megatron_tree.training import trainer

    ckpt = os.path.join(root, "ckpt")
    if dist.get_rank() == 1:
        _on_save_of(4, _no_space)
    os.environ.update(TORCHRUN_JOB)
    try:
        trainer.train(_args(data, *HYBRID, "--save", ckpt, "--save-interval", SAVE_EVERY, "--metrics-jsonl",
                            os.path.join(root, "steps.jsonl")))
        failed = {}
    except CheckpointSaveError as e:
        failed = {"message": str(e), "failures": e.failures, "directory": e.directory, "step": e.step}
    dist.barrier()  # rank 0 cleaned up and left the marker before it raised
    failed["listing"] = sorted(os.listdir(ckpt))
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"  # torchrun --max-restarts restarts the job's ranks
    try:
        trainer.run(_args(data, *HYBRID, "--save", ckpt, "--load", ckpt, "--save-interval", SAVE_EVERY))
        restart = {}
    except CheckpointSaveError as e:
        restart = {"message": str(e), "failures": e.failures, "directory": e.directory, "step": e.step}
    os.environ["TORCHELASTIC_RUN_ID"] = "another-job"
    refuse_restart_after_failed_save(ckpt)  # another job's restart: trains (this raises nothing)
    for key in TORCHRUN_JOB:
        del os.environ[key]
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint import filesystem

    filesystem_async._write_item = filesystem._write_item
    resumed = trainer.train(_args(data, *HYBRID, "--load", ckpt, "--save", ckpt, "--save-interval", SAVE_EVERY))
    return failed, resumed, restart


def _steps(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """(root, data, per-rank results of `_enospc_body`, the failing run's steps 1 to 4: the reference)."""
    root = tmp_path_factory.mktemp("ckpt_faults")
    data = _write_data(root / "d.jsonl")
    ranks = run_distributed(_enospc_body, 2, str(data), str(root), timeout=600)
    return root, data, ranks, _steps(root / "steps.jsonl")


def test_enospc_on_one_rank_stops_every_rank_with_one_clear_error_and_latest_unchanged(faults):
    root, data, ranks, ref = faults
    ckpt = root / "ckpt"
    assert [m["step"] for m in ref] == list(range(1, STEPS + 1))  # the failed save came after step 4
    for rank, (failed, *_) in enumerate(ranks):
        assert "message" in failed, f"rank {rank}: the save of step 4 did not raise"
        msg = failed["message"]
        assert failed["directory"] == str(ckpt) and failed["step"] == 4
        assert list(failed["failures"]) == [1], (rank, failed["failures"])  # rank 0 only echoed the report
        assert failed["failures"][1]["errno"] == errno.ENOSPC
        assert msg.startswith(f"megatron-tree train: the checkpoint of step 4 was NOT saved to {ckpt}/iter_0000004: "
                              "writing (dist_checkpointing.save) failed on rank 1 (rank 1: [ENOSPC: No space left on "
                              "device] "), msg
        assert f"{ckpt}/iter_0000004{PARTIAL_SUFFIX}/" in msg  # the file the write failed on
        assert "Space: the checkpoint needs about " in msg and " of model and optimizer tensors (rank 0 " in msg
        assert f"{ckpt} had " in msg and " free when the save started (the filesystem ran out of space" in msg
        assert f"{ckpt}/latest still names step 2 ({ckpt}/iter_0000002), a complete checkpoint" in msg
        assert f"rerun with --load {ckpt} to resume from step 2" in msg
        # nothing of the failed save is left, latest never moved; under torchrun the save's marker
        assert failed["listing"] == ["iter_0000002", "latest", FAILED_SAVE_MARKER], failed["listing"]
    assert "the partial directory" in ranks[0][0]["message"] and "was removed" in ranks[0][0]["message"]
    # the estimate is the tensors the two ranks write: those the checkpoint's own metadata lists
    # (rank 0 also counts the few tensors of the common state, which common.pt holds)
    need = int(ranks[0][0]["message"].split("the checkpoint needs about ")[1].split(" bytes")[0].replace(",", ""))
    listed = _tensor_bytes(ckpt / "iter_0000002")
    assert listed <= need <= listed + 1024, (need, listed)
    took = sum(f.stat().st_size for f in (ckpt / "iter_0000002").iterdir())
    assert f"the checkpoint of step 2 takes {took:,} bytes" in ranks[1][0]["message"]


def test_a_torchrun_restart_after_a_failed_save_refuses_to_train_again(faults):
    """Under torchrun (``--max-restarts``, the sbatch scripts' MAX_RESTARTS) the failed save leaves
    its marker; the restarted attempt of the same job (``TORCHELASTIC_RESTART_COUNT`` 1) stops in
    `trainer.run` with the same error before it trains, rather than retraining the steps since step 2
    only to fail the same save; a job with another run id is not refused; the next successful save
    removes the marker."""
    root, _, ranks, _ = faults
    ckpt = root / "ckpt"
    failed = ranks[0][0]  # rank 0 wrote the marker: its account of the failure
    for rank, (*_, restart) in enumerate(ranks):
        assert restart, f"rank {rank}: torchrun's restart after the failed save trained again"
        assert restart["message"].startswith(failed["message"] + "\nmegatron-tree: torchrun restart 1 of this "
                                             "job does not train again: the save above failed in an earlier attempt "
                                             f"({ckpt}/{FAILED_SAVE_MARKER})"), restart["message"]
        assert (restart["directory"], restart["step"], restart["failures"]) == \
            (failed["directory"], failed["step"], failed["failures"])
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", "latest"]  # the resume's save cleared it

def _tensor_bytes(path: Path) -> int:
    """Bytes of every tensor a distributed checkpoint's metadata lists (global shapes and dtypes)."""
    import math

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return sum(math.prod(md.size) * torch.empty(0, dtype=md.properties.dtype).element_size()
               for md in FileSystemReader(str(path)).read_metadata().state_dict_metadata.values()
               if isinstance(md, TensorStorageMetadata))


def test_after_enospc_the_previous_checkpoint_loads_and_the_run_resumes_exactly(faults):
    root, _, ranks, ref = faults
    for rank, (_, resumed, _) in enumerate(ranks):
        assert resumed["resumed_from"] == 2, rank
        assert [m["step"] for m in resumed["history"]] == [3, 4]
        _same_steps(resumed["history"], ref, f"rank {rank}: hybrid resumed after ENOSPC")
        assert resumed["saved"] == [str(root / "ckpt" / "iter_0000004")]
    assert latest_checkpoint(str(root / "ckpt")) == 4


# --------------------------------------------------------------------------------------------- killed, failed alone
def _killed_body(data, ckpt, log):
    """Every rank SIGKILLs itself inside dist_checkpointing.save of step 4, once its tensor files are
    written and before the global metadata and metadata.json are: a job killed outright mid-save (a
    time limit's SIGKILL, a lost node), which runs no code of ours afterwards. Rank 0 keeps every
    step in ``log`` (as they end: steps 1 to 4 are there)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_tree.training.trainer import train

    real = FileSystemWriterAsync.retrieve_write_results

    def retrieve_write_results(self):
        if os.path.isdir(os.path.join(ckpt, "iter_0000004" + PARTIAL_SUFFIX)):
            _kill_rank_and_its_children()
        return real(self)

    FileSystemWriterAsync.retrieve_write_results = retrieve_write_results
    train(_args(data, "--save", ckpt, "--save-interval", SAVE_EVERY, "--metrics-jsonl", log))


def _kill_rank_and_its_children() -> None:
    """SIGKILL this process and every process it started, as a batch system ends a job (its whole
    cgroup): dist_checkpointing's helper processes (0.16's spawned Manager of write results) would
    otherwise outlive the rank, holding the test's output open."""
    me = os.getpid()
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError, IndexError):  # not a process, or gone meanwhile
            continue
    os.kill(me, signal.SIGKILL)


def _resume_then_fail_alone_body(data, ckpt, alone):
    """The resume of the killed run; then (last: it leaves the default group unusable) a fresh run
    into ``alone`` whose rank 0 alone fails writing metadata.json of step 4 (a write only it makes,
    at the end of dist_checkpointing.save) while rank 1 waits in dist_checkpointing's closing
    barrier. The outcome exchange times out on rank 0 (shortened to 5 s here), which raises instead
    of hanging; its exit then releases rank 1, which raises too. Returns the resume's result and
    each rank's message."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import serialization

    from megatron_tree.training import trainer

    resumed = trainer.train(_args(data, "--load", ckpt, "--save", ckpt, "--save-interval", SAVE_EVERY))
    trainer.SAVE_OUTCOME_TIMEOUT_S = 5
    if dist.get_rank() == 0:
        real = serialization.save_config

        def save_config(config, checkpoint_dir):
            if "iter_0000004" in str(checkpoint_dir):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(checkpoint_dir, "metadata.json"))
            return real(config, checkpoint_dir)

        serialization.save_config = save_config
    try:
        trainer.train(_args(data, "--save", alone, "--save-interval", SAVE_EVERY))
    except CheckpointSaveError as e:
        return resumed, str(e)
    return resumed, None


@pytest.fixture(scope="module")
def killed(faults, tmp_path_factory):
    """(checkpoint dir, the launcher's error and the directory listing after the kill, per-rank
    results of `_resume_then_fail_alone_body`, the dir of the run failing alone, the killed run's
    steps 1 to 4: the reference)."""
    data = faults[1]
    root = tmp_path_factory.mktemp("killed")
    ckpt, alone = root / "ckpt", root / "alone"
    with pytest.raises(DistributedError) as info:
        run_distributed(_killed_body, 2, str(data), str(ckpt), str(root / "steps.jsonl"), timeout=600)
    listing = {name: sorted(os.listdir(ckpt / name)) for name in os.listdir(ckpt) if (ckpt / name).is_dir()}
    listing["."] = sorted(os.listdir(ckpt))
    ranks = run_distributed(_resume_then_fail_alone_body, 2, str(data), str(ckpt), str(alone), timeout=600)
    return ckpt, str(info.value), listing, ranks, alone, _steps(root / "steps.jsonl")


def test_killed_inside_the_save_leaves_a_partial_dir_that_is_never_loaded_and_resumes_exactly(killed):
    ckpt, error, listing, ranks, _, ref = killed
    assert re.search("rank [01] of 2 was killed by SIGKILL", error), error
    assert [m["step"] for m in ref] == list(range(1, STEPS + 1))  # the kill came after step 4
    partial = "iter_0000004" + PARTIAL_SUFFIX
    assert listing["."] == ["iter_0000002", partial, "latest"], listing
    assert any(n.endswith(".distcp") for n in listing[partial]) and "metadata.json" not in listing[partial], listing
    for rank, (resumed, _) in enumerate(ranks):
        # the run after the kill loaded what latest named (step 2), not the newer partial directory
        assert resumed["resumed_from"] == 2 and [m["step"] for m in resumed["history"]] == [3, 4], rank
        _same_steps(resumed["history"], ref, f"rank {rank}: resumed after a SIGKILL inside the save")
    # the new save of step 4 replaced the killed one's leftovers
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", "latest"]
    assert latest_checkpoint(str(ckpt)) == 4


def test_a_rank_failing_alone_inside_the_save_raises_instead_of_hanging(killed):
    *_, ranks, alone, _ = killed
    msg0, msg1 = ranks[0][1], ranks[1][1]
    assert msg0 is not None and msg1 is not None, (msg0, msg1)
    assert msg0.startswith(f"megatron-tree train: the checkpoint of step 4 was NOT saved to {alone}/iter_0000004: "
                           "writing (dist_checkpointing.save) failed on rank 0 (rank 0: [ENOSPC: No space left on "
                           f"device] OSError: [Errno 28] No space left on device: '{alone}/iter_0000004"), msg0
    assert "rank 0 could not learn the other ranks' outcome (" in msg0 and "it takes the save as failed" in msg0
    assert "rank 1 could not learn the other ranks' outcome (" in msg1, msg1  # released by rank 0's exit
    assert f"{alone}/latest still names step 2" in msg0 and f"{alone}/latest still names step 2" in msg1
    assert sorted(os.listdir(alone)) == ["iter_0000002", "latest"]  # rank 0 removed the partial directory


# --------------------------------------------------------------------------------------------- real full disk
def _load_body(data, ckpt):
    from megatron_tree.training.trainer import train

    return train(_args(data, *HYBRID, "--load", ckpt))


def _mount_tmpfs(path: Path, size: int) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_cli_real_full_filesystem_names_the_error_keeps_latest_and_resumes_exactly(faults, tmp_path):
    """``megatron-tree train --nproc 2`` (the hybrid, as the injected ENOSPC) saving to a tmpfs that
    holds the checkpoint of step 2 but not that of step 4: exit status 1, the error as the run's error
    (not a rank's traceback), ``latest`` names step 2, and a run loading it continues like the
    uninterrupted one."""
    root, data, _, ref = faults  # the hybrid's; the tmpfs is sized by its checkpoint of step 2
    one = sum(-(-f.stat().st_size // 4096) * 4096 for f in (root / "ckpt" / "iter_0000002").iterdir())
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, one + 4096 * 4 + one // 3):  # step 2, its marker, a third of another
        pytest.skip("no small filesystem to fill: mounting a tmpfs needs root (the injected ENOSPC runs anyway)")
    try:
        log = tmp_path / "steps.jsonl"
        rc, out = _run_cli(tmp_path, _argv(data, *LAYOUT, *HYBRID, "--nproc", "2", "--save", disk / "ckpt",
                                           "--save-interval", SAVE_EVERY, "--metrics-jsonl", log))
        assert rc == 1, out[-4000:]
        line = next(x for x in out.splitlines() if "was NOT saved" in x)
        # the message alone, as the run's error (no traceback)
        assert line.startswith(f"megatron-tree train: the checkpoint of step 4 was NOT saved to {disk}/ckpt/iter_0000004: "), line
        assert "Traceback" not in out, out[-4000:]
        assert "[ENOSPC: No space left on device]" in line, line
        free = int(re.search(r" had ([\d,]+) bytes .*? free when the save started", line).group(1).replace(",", ""))
        took = int(re.search(r"the checkpoint of step 2 takes ([\d,]+) bytes", line).group(1).replace(",", ""))
        assert free < took, line  # the sizes that explain it: step 4's checkpoint is as large as step 2's
        print(f"\nmegatron-tree train on a full tmpfs: {line}")
        assert f"{disk}/ckpt/latest still names step 2" in line
        assert "DistributedError" not in out  # the run's error itself, not the launcher's wrapping
        assert sorted(os.listdir(disk / "ckpt")) == ["iter_0000002", "latest"]
        assert latest_checkpoint(str(disk / "ckpt")) == 2
        first = [json.loads(x) for x in log.read_text().splitlines()]
        assert [m["step"] for m in first] == [1, 2, 3, 4]
        _same_steps(first, ref, "run whose save of step 4 hit a full disk")

        # that checkpoint loads, and the run goes on as the uninterrupted one (ranks of this process:
        # a second command line would cost its start-up again)
        for rank, out in enumerate(run_distributed(_load_body, 2, str(data), str(disk / "ckpt"), timeout=600)):
            assert out["resumed_from"] == 2 and [m["step"] for m in out["history"]] == [3, 4], rank
            _same_steps(out["history"], ref, f"rank {rank}: resumed from the checkpoint before the full disk")
    finally:  # lazily when still busy (a rank's file being closed): never left mounted
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], check=True)


# --------------------------------------------------------------------------------------------- load side, launcher
def test_load_reads_only_what_latest_names_and_refuses_a_missing_or_incomplete_one(tmp_path):
    for name, files in (("iter_0000002", ["metadata.json", "common.pt"]), ("iter_0000004", ["__0_0.distcp"]),
                        ("iter_0000006" + PARTIAL_SUFFIX, ["__0_0.distcp"])):
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_text("x")
    marker = tmp_path / "latest"
    assert latest_checkpoint(str(tmp_path)) is None  # no marker: nothing to load, whatever lies there
    marker.write_text("2\n")
    assert latest_checkpoint(str(tmp_path)) == 2  # newer, partial directories are ignored
    marker.write_text("4\n")
    with pytest.raises(ValueError, match=rf"{marker} names step 4, but {tmp_path}/iter_0000004 is incomplete "
                                         r"\(no metadata.json"):
        latest_checkpoint(str(tmp_path))
    marker.write_text("8\n")
    with pytest.raises(ValueError, match=rf"{marker} names step 8, but {tmp_path}/iter_0000008 is missing"):
        latest_checkpoint(str(tmp_path))


def _raise_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise CheckpointSaveError("megatron-tree train: the checkpoint of step 4 was NOT saved to /x/iter_0000004",
                                  directory="/x", step=4, failures={1: {"error": "OSError", "errno": errno.ENOSPC}})
    dist.barrier()  # rank 0 waits here until rank 1 is gone


def test_the_launcher_carries_the_rank_error_and_run_shows_it_without_restarting(tmp_path, monkeypatch, capsys):
    with pytest.raises(DistributedError) as info:
        run_distributed(_raise_on_rank_1, 2, timeout=120)
    carried = info.value.exception
    assert isinstance(carried, CheckpointSaveError) and carried.failures == {1: {"error": "OSError", "errno": 28}}
    assert (carried.directory, carried.step) == ("/x", 4) and "rank 1 of 2 raised" in str(info.value)

    from megatron_tree.training import launch, trainer

    calls = []

    def failing(*a, **kw):
        calls.append(1)
        raise info.value

    monkeypatch.setattr(launch, "run_distributed", failing)
    data = _write_data(tmp_path / "d.jsonl")
    ckpt = tmp_path / "ckpt"
    argv = _argv(data, "--nproc", "2", "--quiet", "--max-restarts", "2", "--save", ckpt, "--load", ckpt)
    with pytest.raises(CheckpointSaveError, match="was NOT saved to /x/iter_0000004"):
        trainer.run(build_train_parser().parse_args(argv))
    assert calls == [1]  # a checkpoint that could not be written is not retried by --max-restarts
    assert trainer.main(argv) == 1
    assert capsys.readouterr().err.strip() == str(carried)


def test_megatron_lm_save_failure_is_named_and_not_retried_by_torchrun(tmp_path, monkeypatch):
    """The hooks' guard of Megatron-LM's ``save_checkpoint`` (`lm_saves.guard_saves`, installed by the
    hooks' dataset provider inside ``pretrain()``), on a stand-in ``megatron.training.training`` whose
    save writes part of ``iter_0000004`` and raises ENOSPC: the error names the directory, the
    iteration, the errno, this rank's tensor bytes and the iteration Megatron-LM's tracker still names;
    under torchrun the marker is left, a restarted attempt of the job refuses before training, another
    job does not, and a successful save clears the marker. (`test_preemption.py`'s Megatron-LM case
    runs the real thing: ENOSPC in a pretrain() save under ``megatron-tree launch --max-restarts 1``.)"""
    import sys
    import types

    import torch

    from megatron_tree.training import lm_saves

    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000002").mkdir(parents=True)
    (ckpt / "iter_0000002" / "model.pt").write_bytes(b"\0" * 1000)
    (ckpt / lm_saves.TRACKER).write_text("2")
    fail = [True]

    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops, **kwargs):
        (ckpt / f"iter_{iteration:07d}").mkdir()
        if fail[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(ckpt / f"iter_{iteration:07d}" / "x.pt"))
        (ckpt / lm_saves.TRACKER).write_text(str(iteration))
        return "saved"

    training = types.ModuleType("megatron.training.training")
    training.save_checkpoint = save_checkpoint
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    for key, value in TORCHRUN_JOB.items():
        monkeypatch.setenv(key, value)
    args = types.SimpleNamespace(save=str(ckpt))
    model = torch.nn.Linear(10, 10)  # 110 float32 parameters: 440 bytes
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 10)).sum().backward()
    optimizer.step()  # exp_avg, exp_avg_sq (440 bytes each) and two step counters (4 bytes each)
    monkeypatch.setattr(lm_saves, "_checked", False)  # a new process (each call below that looks: likewise)
    lm_saves.guard_saves(args)
    lm_saves.guard_saves(args)  # idempotent: wrapped once
    assert training.save_checkpoint.__wrapped__ is save_checkpoint
    with pytest.raises(CheckpointSaveError) as info:
        training.save_checkpoint(4, [model], optimizer, None, 0.0)
    msg = str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    assert msg.startswith(f"megatron-tree (Megatron-LM's save_checkpoint through the hooks): the checkpoint of step 4 "
                          f"was NOT saved to {ckpt}/iter_0000004: Megatron-LM's save_checkpoint failed on rank 0 "
                          f"(rank 0: [ENOSPC: No space left on device] OSError: [Errno 28] No space left on device"), msg
    assert "the checkpoint needs about 1,328 bytes (1.3 KiB) of model and optimizer tensors (rank 0 1,328)" in msg, msg
    assert "the checkpoint of step 2 takes 1,000 bytes on disk" in msg, msg
    assert f"{ckpt}/{lm_saves.TRACKER} still names step 2 ({ckpt}/iter_0000002), a complete checkpoint" in msg, msg
    assert f"rerun with --load {ckpt} to resume from step 2" in msg and "the filesystem ran out of space" in msg
    assert (info.value.directory, info.value.step) == (str(ckpt), 4)
    assert (ckpt / FAILED_SAVE_MARKER).exists() and (ckpt / lm_saves.TRACKER).read_text() == "2"

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarts the job's ranks
    lm_saves.guard_saves(args)  # this process looked already (once per process: every forward step calls it)
    monkeypatch.setattr(lm_saves, "_checked", False)
    with pytest.raises(CheckpointSaveError, match="torchrun restart 1 of this job does not train again") as again:
        lm_saves.guard_saves(args)
    assert str(again.value).startswith(msg)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-job")  # a new launch after the disk was cleaned up
    monkeypatch.setattr(lm_saves, "_checked", False)
    lm_saves.guard_saves(args)
    fail[0] = False
    assert training.save_checkpoint(6, [model], optimizer, None, 0.0) == "saved"
    assert not (ckpt / FAILED_SAVE_MARKER).exists() and (ckpt / lm_saves.TRACKER).read_text() == "6"


# ------------------------------------------------------------------------------- a peer lost mid-save
def test_a_save_broken_by_a_lost_peer_leaves_no_marker_and_the_restart_trains(tmp_path, monkeypatch):
    """Under torchrun, rank 1 killed (OOM, a crash) while rank 0 saves: rank 0's save fails only
    because its collective broke (gloo's text, no errno). That leaves no marker, so torchrun's restart
    trains again from the last checkpoint, as it does when rank 0 is the one killed (which writes
    nothing). A storage error (ENOSPC) still leaves one and the restart is refused. (CI once killed
    rank 1 inside a periodic save of the Megatron-LM chain: the restart was refused.)"""
    from megatron_tree.training.checkpoint_errors import lost_peer, record_failed_save

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    reset = {0: {"error": "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
                          "error [127.0.0.1]:52913: Connection reset by peer. This is typically caused by a remote "
                          "worker hanging or bugs in the application.", "errno": None, "logged": []}}
    enospc = {1: {"error": "OSError: [Errno 28] No space left on device", "errno": errno.ENOSPC, "logged": []}}
    assert lost_peer(reset) and not lost_peer(enospc) and not lost_peer({})
    assert not lost_peer({**reset, **enospc})  # one rank's storage failed: that is the save's cause

    def attempt(failures):
        ckpt = tmp_path / f"ckpt{len(list(tmp_path.iterdir()))}"
        ckpt.mkdir()
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
        marker = record_failed_save(str(ckpt), CheckpointSaveError("the save of step 6 failed", directory=str(ckpt),
                                                                   step=6, failures=failures))
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        try:
            refuse_restart_after_failed_save(str(ckpt))
        except CheckpointSaveError as e:
            return marker, str(e)
        return marker, None

    marker, refused = attempt(reset)
    assert marker is None and refused is None
    marker, refused = attempt(enospc)
    assert marker is not None and marker.endswith(FAILED_SAVE_MARKER)
    assert refused.startswith("the save of step 6 failed") and "does not train again" in refused
