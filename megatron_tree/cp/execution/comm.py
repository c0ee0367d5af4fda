"""Row-block all-to-all for context parallelism.

Two layers:

* `start_exchange(send, send_splits, recv_splits, group)` -> `Exchange`: one
  ``all_to_all_single`` of row blocks with split sizes, issued asynchronously (``async_op=True``);
  ``Exchange.wait()`` returns the received block. This is what the attention executor uses inside
  its own autograd Function, so it can issue the fetch of wave ``w + 1`` before computing wave ``w``
  and overlap the return of dK/dV with the backward of the next stage. `start_fetch` / `received`
  run one wave of a `CPSchedule` (the plan's host-side KV schedule) through it.
* `fetch_rows(x, send_local, send_splits, recv_splits, group)`: the same move as an autograd op.
  Forward gathers the local rows ``x[send_local]`` (grouped by destination) and sends them;
  backward sends the received rows' gradients back to their owners, who ADD them into the gradient
  of ``x`` (``index_add``): a fetch replicates a row onto every rank that needs it, and the
  transpose of a replicating gather is an accumulation.

Every rank must enter every exchange, in the same order, even with zero rows to send or receive:
``all_to_all_single`` is an ordered collective, and a rank that skipped one would pair its next
collective with another rank's previous one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Exchange", "start_exchange", "start_fetch", "received", "fetch_rows", "group_rank"]


def group_rank(plan, group, who: str) -> int:
    """This process's rank in the CP ``group`` that ``plan`` was made for (0 with no group at CP1).

    Raises before any collective, identically on every rank: a CP size > 1 without an initialised
    process group, a process outside ``group``, or a group whose size is not ``plan.cp_size``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if plan.cp_size == 1:
            return 0  # no process group needed: nothing moves
        raise RuntimeError(f"{who} with cp_size={plan.cp_size} needs an initialised torch.distributed")
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(f"{who}: this process is not a member of the given CP group")
    if size != plan.cp_size:
        raise ValueError(f"{who}: the CP group has {size} ranks but the plan was made for cp_size={plan.cp_size}")
    return rank


class Exchange:
    """An all-to-all in flight. ``wait()`` returns the received rows [sum(recv_splits), ...]."""

    def __init__(self, out: torch.Tensor, work, send: torch.Tensor):
        self._out, self._work = out, work
        self._send = send  # the send buffer must stay alive until the collective has read it

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._send = None
        return self._out


def start_exchange(send: torch.Tensor, send_splits, recv_splits, group=None, *, async_op: bool = True) -> Exchange:
    """Issue ``all_to_all_single`` of the row block ``send`` [sum(send_splits), F].

    ``send_splits[d]`` rows (consecutive, destination order) go to rank ``d`` of ``group``;
    ``recv_splits[s]`` rows arrive from rank ``s``. Returns an `Exchange`; the output buffer
    [sum(recv_splits), F] is valid after ``wait()``. A group of size 1 moves nothing.
    """
    send_splits, recv_splits = [int(x) for x in send_splits], [int(x) for x in recv_splits]
    if send.shape[0] != sum(send_splits):
        raise ValueError(f"send buffer has {send.shape[0]} rows but send_splits sum to {sum(send_splits)}")
    out = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
    if dist.get_world_size(group) == 1:
        out.copy_(send)
        return Exchange(out, None, send)
    send = send.contiguous()
    work = dist.all_to_all_single(out, send, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                                  group=group, async_op=async_op)
    return Exchange(out, work if async_op else None, send)


def start_fetch(sched, pack: torch.Tensor, w: int, group=None):
    """Start wave ``w`` of the schedule ``sched`` (a `CPSchedule`): send the rows of ``pack``
    [n_local, F] (this rank's owned rows, any features) that other ranks need. None when no rank
    moves a row in that wave (decided from the global plan, so every rank skips it alike). Pair
    with `received`."""
    wave = sched.waves[w]
    if wave.global_rows == 0:
        return None
    send = pack.index_select(0, sched.device_indices(pack.device)["waves"][w]["send_local"])
    return start_exchange(send, wave.send_splits, wave.recv_splits, group)


def received(sched, ex, pack: torch.Tensor, w: int) -> torch.Tensor:
    """Wave ``w``'s remote rows [m, F] from `start_fetch`'s exchange ``ex``, in ascending global
    row order (``sched.waves[w].rows``); ``pack`` only supplies dtype / device / width when ``ex``
    is None."""
    if ex is None:
        return pack.new_empty((0, pack.shape[1]))
    return ex.wait().index_select(0, sched.device_indices(pack.device)["waves"][w]["sorted_from_recv"])


class _FetchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_local, send_splits, recv_splits, group):
        ctx.save_for_backward(send_local)
        ctx.splits, ctx.group, ctx.n = (send_splits, recv_splits), group, x.shape[0]
        return start_exchange(x.index_select(0, send_local), send_splits, recv_splits, group).wait()

    @staticmethod
    def backward(ctx, grad):
        (send_local,) = ctx.saved_tensors
        send_splits, recv_splits = ctx.splits
        # the reverse move: what we received goes back to its owner
        back = start_exchange(grad.contiguous(), recv_splits, send_splits, ctx.group).wait()
        dx = grad.new_zeros((ctx.n,) + tuple(grad.shape[1:]))
        dx.index_add_(0, send_local, back)  # a row sent to several ranks collects all their grads
        return dx, None, None, None, None


def fetch_rows(x: torch.Tensor, send_local: torch.Tensor, send_splits, recv_splits, group=None) -> torch.Tensor:
    """Autograd all-to-all of rows: send ``x[send_local]`` (grouped by destination, ``send_splits``
    rows each), receive [sum(recv_splits), ...] (grouped by source). The gradient of a received row
    returns to its owner and is added to ``x``'s gradient at the sent index (a row sent to several
    ranks accumulates all their contributions). Every rank of ``group`` must call it, in the same
    order, also with nothing to send or receive.
    """
    return _FetchRows.apply(x, send_local, tuple(send_splits), tuple(recv_splits), group)
