"""The launcher's record of a failing rank (`megatron_tree.training.launch`): a rank's .err file is
whole or absent (`training.files.write_atomically`), so the parent names the first failing rank even
when a rank is signalled while it writes its own (CI once read an empty .err there and failed on
``float('')`` instead)."""
import os

import pytest

from megatron_tree.training import launch
from megatron_tree.training.files import write_atomically


class _Signalled(BaseException):
    """What a SIGTERM handler raises in a rank halfway through a write."""


def test_a_rank_signalled_while_writing_its_error_leaves_no_file(tmp_path, monkeypatch):
    write_atomically(str(tmp_path / "rank0.err"), b"12.5\nTraceback: rank 0 failed first\n")

    real_open = open

    def torn_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        if "w" in mode:
            def write(data):
                f.__class__.write(f, data[: len(data) // 2])
                raise _Signalled
            f.write = write
        return f

    monkeypatch.setattr("builtins.open", torn_open)
    with pytest.raises(_Signalled):
        write_atomically(str(tmp_path / "rank1.err"), b"11.0\nTraceback: rank 1 (cut short)\n")
    monkeypatch.undo()

    assert not (tmp_path / "rank1.err").exists()  # the torn write never reaches the target
    assert not (tmp_path / "rank1.err.tmp").exists()  # and its temporary file is gone
    assert launch._first_failing_rank(str(tmp_path), 2) == 0
    assert launch._first_error(str(tmp_path), 2) == "rank 0 of 2 raised:\nTraceback: rank 0 failed first\n"


def test_the_oldest_whole_error_names_the_rank(tmp_path):
    for rank, stamp in ((0, 20.0), (1, 10.0)):
        write_atomically(str(tmp_path / f"rank{rank}.err"), f"{stamp!r}\nboom {rank}\n".encode())
    assert launch._first_failing_rank(str(tmp_path), 2) == 1
    assert launch._first_error(str(tmp_path), 2) == "rank 1 of 2 raised:\nboom 1\n\n(ranks [0] failed afterwards)"
    assert sorted(os.listdir(tmp_path)) == ["rank0.err", "rank1.err"]
