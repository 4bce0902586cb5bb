"""The benchmark's child processes and command list: time limits, process groups, imports."""

from __future__ import annotations

import ast
import os
import subprocess
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


def test_capture_keeps_stdout_and_stderr_apart_and_checks_the_exit() -> None:
    code = "import sys; print('answer'); print('noise', file=sys.stderr); sys.exit(3)"
    got = Children().capture([sys.executable, "-c", code], os.environ, 30)
    assert (got.rc, got.stdout, got.stderr) == (3, "answer\n", "noise\n")
    assert not got.exit.timed_out
    with pytest.raises(subprocess.CalledProcessError):
        got.check()


SYSTEM_TOOLS = {"mount", "umount", "chmod", "du", "nvidia-smi"}
"""Commands a benchmark may run directly: the machine's tools, not a benchmark child."""


def test_every_benchmark_child_starts_in_children() -> None:
    """No module of ``benchmarks/tqbench`` but ``children`` starts a process (``subprocess``
    or ``os.fork``/``multiprocessing``), but for a machine tool named by a literal command:
    so every child of a benchmark is in its own group, time-limited, and killed on SIGTERM."""
    starts = {"run", "Popen", "call", "check_call", "check_output", "fork", "Process"}
    found = []
    for path in sorted((REPO_ROOT / "benchmarks" / "tqbench").glob("*.py")):
        if path.name == "children.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            if not (isinstance(owner, ast.Name) and owner.id in {"subprocess", "os", "mp"}):
                continue
            if node.func.attr not in starts:
                continue
            first = node.args[0] if node.args else None
            tool = (
                first.elts[0].value
                if isinstance(first, ast.List)
                and first.elts
                and isinstance(first.elts[0], ast.Constant)
                else None
            )
            if tool in SYSTEM_TOOLS or (isinstance(first, ast.Name) and first.id == "du"):
                continue
            found.append(f"{path.name}:{node.lineno}")
    assert found == []


def test_no_benchmark_reaches_a_private_name_of_the_plugin() -> None:
    """A benchmark calls the plugin through public names (``batched_verify.serve_rows``,
    where it once called the guard's private ``_serve``)."""
    found = []
    for path in sorted((REPO_ROOT / "benchmarks" / "tqbench").glob("*.py")):
        tree = ast.parse(path.read_text())
        plugin = {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tq_warmup")
            for alias in node.names
        }
        found += [
            f"{path.name}:{node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in plugin
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ]
        found += [f"{path.name}:{name}" for name in plugin if name.startswith("_")]
    assert found == []
