"""The package's shape: the public names, what ``register()`` imports, no import cycle."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import sys
import warnings
from importlib import metadata
from pathlib import Path

import fakes
import pytest

import tq_warmup_plugin
from tq_warmup_plugin import geometry, hookspecs, keys, settings
from tq_warmup_plugin.vllm_kernels import jobs

PACKAGE = Path(tq_warmup_plugin.__file__).parent
NAME = tq_warmup_plugin.__name__

# What ``import tq_warmup_plugin; register()`` imported before issue 14 (Python 3.11):
# the package's modules on the register path, and the top-level names of the standard
# library modules they pull in. 3.10 parses regular expressions with sre_*. Since
# issue 13 also ``multinode`` (TQ_WARMUP* forwarded to Ray workers, stdlib only); since
# issue 11 the chunked-local boundary guard (stdlib only); since issue 23 the batched
# verify guard and its rows (stdlib only: torch is imported when a builder builds);
# since issue 21 ``compat`` is a package of four modules (the same names, by concern);
# since issue 54 the compile-ahead fork and the verify rows live in ``vllm_kernels`` and
# ``worker``, whose ``__init__`` modules import nothing.
REGISTER_MODULES = {
    NAME,
    f"{NAME}.vllm_kernels",
    f"{NAME}.vllm_kernels.ahead",
    f"{NAME}.compat",
    f"{NAME}.compat.live",
    f"{NAME}.compat.releases",
    f"{NAME}.compat.triton",
    f"{NAME}.compat.vllm_kernels",
    f"{NAME}.compat.vllm_moe",
    f"{NAME}.compat.vllm_paths",
    f"{NAME}.guards",
    f"{NAME}.guards.draft_seq_lens",
    f"{NAME}.guards.gate",
    f"{NAME}.guards.local_boundary",
    f"{NAME}.guards.prefix_fast_path",
    f"{NAME}.guards.batched_verify",
    f"{NAME}.worker",
    f"{NAME}.worker.verify_rows",
    f"{NAME}.guards.spec_graphs",
    f"{NAME}.guards.v1_cache_dtype",
    f"{NAME}.install",
    f"{NAME}.patching",
    f"{NAME}.multinode",
    f"{NAME}.settings",
}
OPTIONAL = {"triton", "torch", "vllm"}  # present beside vLLM, absent in the lint venv
REGISTER_STDLIB = {
    *("__future__", "ast", "atexit", "collections", "contextlib", "copy", "copyreg"),
    *("dataclasses", "dis", "enum", "functools", "importlib", "inspect", "itertools"),
    *("keyword", "linecache", "logging", "math", "opcode", "operator", "re", "reprlib"),
    *("string", "textwrap", "threading", "token", "tokenize", "traceback", "types"),
    *("typing", "warnings", "weakref", "sre_compile", "sre_constants", "sre_parse"),
}


def test_public_names_exist_and_are_the_package_objects() -> None:
    assert len(set(tq_warmup_plugin.__all__)) == len(tq_warmup_plugin.__all__)
    for name in tq_warmup_plugin.__all__:
        assert getattr(tq_warmup_plugin, name) is not None, name
    assert set(tq_warmup_plugin.__all__) <= set(dir(tq_warmup_plugin))
    assert tq_warmup_plugin.hookimpl is hookspecs.hookimpl
    assert tq_warmup_plugin.Geometry is geometry.Geometry
    assert tq_warmup_plugin.KernelKey is keys.KernelKey
    assert tq_warmup_plugin.Settings is settings.Settings
    assert tq_warmup_plugin.Job is jobs.Job and tq_warmup_plugin.Engine is jobs.Engine
    assert tq_warmup_plugin.Declined is jobs.Declined
    try:
        installed = metadata.version("tq-warmup-plugin")
    except metadata.PackageNotFoundError:
        installed = "0+unknown"
    assert tq_warmup_plugin.__version__ == installed


def test_every_module_declares_an_all_of_its_own_objects() -> None:
    declared = 0
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix=f"{NAME}."):
        try:
            with warnings.catch_warnings():  # the old engine path warns, tested below
                warnings.simplefilter("ignore", DeprecationWarning)
                module = importlib.import_module(info.name)
        except ModuleNotFoundError as exc:  # layered_cache subclasses Triton's manager
            assert exc.name in OPTIONAL, exc
            continue
        assert info.ispkg or hasattr(module, "__all__"), f"{info.name} declares no __all__"
        for name in getattr(module, "__all__", ()):
            assert hasattr(module, name), (info.name, name)
            declared += 1
    assert declared


def test_register_imports_no_module_beyond_what_it_did() -> None:
    code = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        "import tq_warmup_plugin; tq_warmup_plugin.register()\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    new = set(json.loads(fakes.fresh_python(code).splitlines()[-1]))
    assert {m for m in new if m.split(".")[0] == NAME} == REGISTER_MODULES
    others = {m.split(".")[0] for m in new if m.split(".")[0] != NAME}
    # Private C accelerators (_sre, _typing, ...) differ between Python releases.
    public = {m for m in others if not (m.startswith("_") and m in sys.stdlib_module_names)}
    assert public <= REGISTER_STDLIB, sorted(public - REGISTER_STDLIB)
    assert "importlib.metadata" not in new and "pluggy" not in new


def _imports(package_dir: Path, path: Path, module: str) -> set[str]:
    """The package modules ``module`` imports anywhere in its source, lazily included."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # ``from pkg import name``: a submodule when one exists, else pkg itself.
            targets = [
                f"{base}.{a.name}" if _is_module(package_dir, f"{base}.{a.name}") else base
                for a in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t.split(".")[0] == NAME and t != module)
    return found


def _is_module(package_dir: Path, name: str) -> bool:
    rel = package_dir.joinpath(*name.split(".")[1:])
    return rel.with_suffix(".py").is_file() or (rel / "__init__.py").is_file()


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports (at module level or inside functions)."""
    graph: dict[str, set[str]] = {}
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[module] = _imports(package_dir, path, module)
    return graph


def first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return [*path, module, target]
            if target not in state and (cycle := visit(target, [*path, module])):
                return cycle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module, [])):
            return cycle[cycle.index(cycle[-1]) :]
    return None


def test_no_import_cycle_among_the_package_modules() -> None:
    """Lazy imports count: before issue 14, ``hookspecs.plugin_manager`` imported the
    built-in warmers, which import ``hookspecs`` (hookspecs -> warmers.triton_jit ->
    hookspecs); the host owns the manager now (``plugins``, apart from ``warmup`` since the
    compile-ahead child is a fork: ahead -> ahead_child -> warmup -> ahead was a cycle)."""
    graph = import_graph(PACKAGE)
    plugins = f"{NAME}.worker.plugins"
    assert graph[plugins] >= {f"{NAME}.hookspecs", f"{NAME}.warmers.turboquant"}
    assert plugins in graph[f"{NAME}.worker.warmup"]
    assert first_cycle(graph) is None
    assert first_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


ROOT = PACKAGE.parents[1]
CACHE_MANAGER = "tq_warmup_plugin.layered_cache:LayeredCacheManager"
"""What operators write in ``TRITON_CACHE_MANAGER`` (README, ``deploy/``)."""


def _pyproject() -> str:
    return (ROOT / "pyproject.toml").read_text()


def test_the_operator_surface_is_what_operators_wrote_down() -> None:
    """The names outside Python that operators write: the entry point vLLM loads, the
    ``tq-warmup`` script, the cache manager's path (in ``deploy/`` and the README) and
    the settings; the package's module paths are not among them."""
    assert 'tq_warmup = "tq_warmup_plugin:register"' in _pyproject()
    assert 'tq-warmup = "tq_warmup_plugin.cli:main"' in _pyproject()
    from tq_warmup_plugin import cli

    assert callable(cli.main) and callable(tq_warmup_plugin.register)
    for deployed in (ROOT / "deploy/kubernetes.yaml", ROOT / "deploy/Containerfile"):
        assert CACHE_MANAGER in deployed.read_text(), deployed
    assert CACHE_MANAGER in (ROOT / "README.md").read_text()
    assert settings.MANAGERS[0] == CACHE_MANAGER
    assert all(name.startswith("TQ_WARMUP") for name in settings.KNOWN)
    done = fakes.fresh_python(
        "import contextlib, io, runpy, sys\n"
        "sys.argv = ['tq-warmup', '--help']\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "    runpy.run_module('tq_warmup_plugin.cli', run_name='__main__')\n"
        "print('usage' in out.getvalue())\n"
    )
    assert done.splitlines()[-1] == "True"  # python -m tq_warmup_plugin.cli


def test_the_cache_managers_path_is_the_one_alias() -> None:
    """``tq_warmup_plugin.layered_cache`` *is* ``shipped.layered_cache`` (in a fresh
    interpreter, so no other test imported either first); no other module is an alias."""
    code = (
        "import importlib, json\n"
        "try:\n"
        "    a = importlib.import_module('tq_warmup_plugin.layered_cache')\n"
        "    same = a is importlib.import_module('tq_warmup_plugin.shipped.layered_cache')\n"
        "except ModuleNotFoundError as exc:  # it subclasses Triton's manager\n"
        "    same = exc.name\n"
        "print(json.dumps(same))\n"
    )
    same = json.loads(fakes.fresh_python(code).splitlines()[-1])
    assert same is True or same in OPTIONAL, same
    aliases = {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if "sys.modules[__name__] =" in p.read_text()
    }
    assert aliases == {"layered_cache.py"}


def test_the_old_engine_path_warns_and_holds_the_same_types() -> None:
    """docs/writing-a-warmer.md named ``tq_warmup_plugin.engine``: for one release it
    re-exports the types, with a DeprecationWarning; the package exports them."""
    code = (
        "import json, warnings\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    from tq_warmup_plugin.engine import Declined, Engine, Job\n"
        "import tq_warmup_plugin as p\n"
        "print(json.dumps([[w.category.__name__ for w in seen],\n"
        "                  (Declined, Engine, Job) == (p.Declined, p.Engine, p.Job)]))\n"
    )
    categories, same = json.loads(fakes.fresh_python(code).splitlines()[-1])
    assert categories == ["DeprecationWarning"] and same


def test_the_documented_cache_manager_path_resolves_to_the_class() -> None:
    pytest.importorskip("triton")
    from tq_warmup_plugin.shipped import layered_cache

    for name in layered_cache.MANAGER_NAMES:  # as Triton resolves TRITON_CACHE_MANAGER
        module, _, cls = name.partition(":")
        assert getattr(importlib.import_module(module), cls) is layered_cache.LayeredCacheManager
    assert layered_cache.MANAGER == CACHE_MANAGER
