"""The benchmark's child processes and command list: time limits, process groups, imports."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from benchmarks.tqbench import cli
from benchmarks.tqbench.children import Children, Deadline, child_pythonpath
from benchmarks.tqbench.engine import REPO_ROOT


def test_a_child_past_its_limit_is_killed_with_its_group(tmp_path: Path) -> None:
    """The child starts a grandchild (as vLLM's engine starts workers); both die."""
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); "
        "time.sleep(60)"
    )
    children = Children()
    t = time.monotonic()
    ended = children.run([sys.executable, "-c", code], tmp_path / "c.log", os.environ, 3.0)
    assert ended.timed_out and ended.rc < 0 and time.monotonic() - t < 30
    assert "started" in (tmp_path / "c.log").read_text() and not children.procs
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    for _ in range(50):  # the kill is asynchronous; a killed orphan is gone or a zombie
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in "ZX":
            break
        time.sleep(0.1)
    else:
        pytest.fail("the grandchild outlived its group's kill")


def test_a_child_that_ends_reports_its_code_and_the_command_heads_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('hi'); sys.exit(3)"]
    ended = Children().run(argv, tmp_path / "c.log", os.environ, 30.0, echo_argv=True)
    assert (ended.rc, ended.timed_out) == (3, False)
    first, second = (tmp_path / "c.log").read_text().splitlines()[:2]
    assert first.startswith("$ ") and sys.executable in first and second == "hi"


def test_deadline_limits_each_child() -> None:
    assert Deadline(0).left() == float("inf") and Deadline(0).limit(600) == 600
    soon = Deadline(20)
    assert 19 < soon.left() <= 20
    assert soon.limit(600, margin=5) <= 15 and soon.limit(5) == 5
    assert Deadline(1e-9).limit(600) == 1.0  # past it: still a positive limit


def test_child_pythonpath_puts_the_checkout_between_the_stub_and_the_parent() -> None:
    path = child_pythonpath(["/stub"], {"PYTHONPATH": "/mine"}).split(os.pathsep)
    assert path == ["/stub", str(REPO_ROOT), "/mine"]
    assert child_pythonpath([], {}) == str(REPO_ROOT)


def test_a_command_module_that_does_not_import_is_an_error_naming_it() -> None:
    with pytest.raises(ImportError, match=r"benchmarks\.tqbench\.no_such_command"):
        cli.command_modules(("run", "no_such_command"))
    assert [m.__name__.rsplit(".", 1)[1] for m in cli.command_modules()] == list(
        cli.COMMAND_MODULES
    )
