"""The folder is the marker (tests/conftest.py): every test under tests/process/ is marked slow, and a test under
tests/unit/ that is marked slow or calls run_cli is a process test in the wrong folder (refused once switched on)."""

from __future__ import annotations

import types

import conftest
import pytest
from conftest import PROCESS, UNIT, run_cli


def item(folder, name: str, function, *, slow: bool = False):
    """A collected test as the hook sees it: its path, node id, markers and function."""
    markers = ["slow"] if slow else []
    return types.SimpleNamespace(
        path=folder / "test_x.py",
        nodeid=f"{folder.name}/test_x.py::{name}",
        function=function,
        get_closest_marker=lambda name: name if name in markers else None,
        add_marker=lambda mark: markers.append(mark.name),
    )


def starts_a_process():
    return run_cli("--help")


def starts_one_in_a_lambda():
    return (lambda: run_cli("--help"))()


def in_process():
    return conftest.run_main


def test_a_function_that_names_run_cli_is_seen_and_one_that_does_not_is_not():
    assert conftest.calls_run_cli(starts_a_process) and conftest.calls_run_cli(starts_one_in_a_lambda)
    assert not conftest.calls_run_cli(in_process) and not conftest.calls_run_cli(None)


def test_the_process_folder_marks_its_tests_slow_and_the_unit_folder_keeps_only_in_process_ones(monkeypatch):
    items = [
        item(PROCESS, "test_a", in_process),
        item(UNIT, "test_b", in_process),
        item(UNIT, "test_c", in_process, slow=True),
        item(UNIT, "test_d", starts_a_process),
    ]
    monkeypatch.setattr(conftest, "REFUSE_PROCESS_TESTS_IN_UNIT", False)
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.get_closest_marker("slow") is not None for i in items] == [True, False, True, False]
    assert conftest.misplaced_process_tests(items) == ["unit/test_x.py::test_c", "unit/test_x.py::test_d"]

    monkeypatch.setattr(conftest, "REFUSE_PROCESS_TESTS_IN_UNIT", True)
    with pytest.raises(pytest.UsageError, match=r"^2 test\(s\) under tests/unit/ start processes .*test_c.*test_d"):
        conftest.pytest_collection_modifyitems(None, items)
    conftest.pytest_collection_modifyitems(None, items[:2])  # only in-process tests under tests/unit: accepted


def test_the_conftest_tests_import_is_the_one_whose_hooks_run(request):
    """run_cli reads the state pytest_runtest_setup sets: a second copy of conftest (imported by name from
    tests/, beside pytest's own import of it) would hold a state no hook sets."""
    assert request.config.pluginmanager.is_registered(conftest)
    assert conftest._in_slow_test == [False]  # this test, in tests/unit/, is not slow: set by the hook


def test_each_worker_starts_with_its_share_of_the_longest_tests_and_the_shares_stay_whole(monkeypatch):
    """longest_first: worksteal sends worker k the k-th contiguous share (len // workers, in turn); each share
    starts with the LONGEST tests dealt to it, longest first, and holds the others in their collected order."""
    monkeypatch.setattr(conftest, "LONGEST", ("process/test_x.py::long_a", "process/test_x.py::long_b"))
    items = [item(PROCESS, name, None) for name in ("quick_1", "quick_2", "long_b[case]", "quick_3", "long_a")]
    items += [item(UNIT, f"unit_{k}", None) for k in range(5)]
    ordered = [i.nodeid.split("::")[1] for i in conftest.longest_first(items, 2)]
    assert ordered[:5] == ["long_a", "quick_1", "quick_2", "quick_3", "unit_0"]  # worker 0's 10 // 2
    assert ordered[5:] == ["long_b[case]", "unit_1", "unit_2", "unit_3", "unit_4"]  # worker 1's
    assert conftest.longest_first(items, 1) == items  # one process: the collected order


def test_every_longest_test_is_a_test_of_the_suite():
    """A renamed test would silently lose its place at the front: each LONGEST name is a test function in its file."""
    for name in conftest.LONGEST:
        path, function = name.split("::")
        assert f"def {function}(" in (conftest.ROOT / path).read_text(), name
