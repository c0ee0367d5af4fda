"""Module fixtures that run only the cases this session will assert.

A module-scoped fixture that runs a whole list of configs in one batch (``run_verify_many``) would
still run the cases that ``-k``, ``--deselect`` or the latest tier (``conftest.py``) left out.
``selected_cases(request, "test_name", cases)`` returns ``{index: case}`` for the parametrized
``test_name[...]`` items of the calling module that are in the session, in list order.
"""
from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def selected_cases(request, test_name: str, cases: Sequence[T], argname: str = "i") -> dict[int, T]:
    """``{i: cases[i]}`` for every ``test_name`` item of this module the session will run
    (parametrized by index ``argname``)."""
    wanted = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if (callspec is not None and getattr(item, "originalname", None) == test_name
                and item.module is request.module and argname in callspec.params):
            wanted.add(callspec.params[argname])
    return {i: cases[i] for i in sorted(wanted)}


def run_selected(request, test_name: str, cases: Sequence[T], run) -> dict[int, object]:
    """``run(list_of_cases)`` on the selected cases only; results keyed by their index in ``cases``."""
    chosen = selected_cases(request, test_name, cases)
    results = run(list(chosen.values())) if chosen else []
    return dict(zip(chosen, results))
