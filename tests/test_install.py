"""Hooking vLLM's kernel_warmup: call sites, import hook, register(), failure isolation."""

from __future__ import annotations

import importlib
import json
import logging
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fakes
import pytest
from conftest import Log

import tq_warmup_plugin
from tq_warmup_plugin import compat, install, settings
from tq_warmup_plugin.settings import Settings
from tq_warmup_plugin.worker import warmup
from tq_warmup_plugin.worker.report import Report


@pytest.fixture
def sites(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """vLLM's three call-site modules bound to one ``kernel_warmup``; calls are recorded
    in order, ours as ("warm", worker), vLLM's as ("original", worker, kwargs)."""
    calls: list[tuple] = []

    def kernel_warmup(worker: Any, *args: Any, **kwargs: Any) -> str:
        calls.append(("original", worker, kwargs))
        return "done"

    modules = {}
    for name in compat.CALL_SITE_MODULES:
        modules[name] = types.ModuleType(name)
        modules[name].kernel_warmup = kernel_warmup  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, name, modules[name])
    monkeypatch.setattr(install, "warm_worker", lambda w, s: calls.append(("warm", w)))
    yield SimpleNamespace(original=kernel_warmup, modules=modules, calls=calls)
    install.uninstall()


def hooks() -> int:
    return sum(isinstance(f, install._PatchOnImport) for f in sys.meta_path)


def bound(sites: SimpleNamespace) -> set[Any]:
    return {m.kernel_warmup for m in sites.modules.values()}


def test_install_rebinds_every_call_site_to_one_wrapper(sites: SimpleNamespace) -> None:
    install.install(Settings())
    (wrapper,) = bound(sites)
    assert wrapper is not sites.original and install.installed() and hooks() == 1
    elastic = sites.modules[compat.ELASTIC_MODULE]
    assert elastic.kernel_warmup("w", process_local_only=True) == "done"
    assert sites.calls == [("warm", "w"), ("original", "w", {"process_local_only": True})]


def test_install_twice_does_not_wrap_twice(sites: SimpleNamespace) -> None:
    install.install(Settings())
    install.install(Settings(strict=True))
    (wrapper,) = bound(sites)
    assert wrapper.__tq_warmup_original__ is sites.original
    assert hooks() == 1
    sites.modules[compat.WORKER_MODULE].kernel_warmup("w")
    assert [c[0] for c in sites.calls] == ["warm", "original"]


def test_a_late_call_site_gets_the_same_wrapper(sites: SimpleNamespace) -> None:
    install.install(Settings())
    sites.modules[compat.ELASTIC_MODULE].kernel_warmup = sites.original
    install.install(Settings())
    (wrapper,) = bound(sites)
    wrapper("w")
    assert [c[0] for c in sites.calls] == ["warm", "original"]


def test_foreign_or_absent_call_sites_are_left_alone(
    sites: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    def theirs(worker: Any) -> None: ...

    sites.modules[compat.ELASTIC_MODULE].kernel_warmup = theirs
    monkeypatch.delitem(sys.modules, compat.WORKER_MODULE)
    install.install(Settings())
    assert sites.modules[compat.ELASTIC_MODULE].kernel_warmup is theirs
    assert install.installed()


def test_uninstall_restores_vllm_everywhere(sites: SimpleNamespace) -> None:
    install.install(Settings())
    install.uninstall()
    assert bound(sites) == {sites.original}
    assert hooks() == 0 and not install.installed()


def test_import_hook_patches_a_module_imported_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sites: SimpleNamespace
) -> None:
    name = "tqfake_vllm_pkg.kernel_warmup"
    source = (
        "def kernel_warmup(worker, *args, **kwargs):\n    return ('original', worker, kwargs)\n"
    )
    monkeypatch.setattr(compat, "WARMUP_MODULE", name)
    monkeypatch.setattr(compat, "CALL_SITE_MODULES", (name,))
    with fakes.package_on_path(tmp_path, monkeypatch, name, source):
        install.install(Settings())
        try:
            module = importlib.import_module(name)
            assert install.installed()
            result = module.kernel_warmup("w", process_local_only=True)
            assert result == ("original", "w", {"process_local_only": True})
            assert sites.calls == [("warm", "w")]
        finally:
            install.uninstall()
    assert not hasattr(module.kernel_warmup, "__tq_warmup_original__")


@pytest.fixture
def installs(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    """A fresh ``register()`` whose ``install`` only records its settings (conftest
    clears the caller's ``TQ_WARMUP*``)."""
    monkeypatch.setattr(tq_warmup_plugin, "_registered", False)
    calls: list[Settings] = []
    monkeypatch.setattr(install, "install", calls.append)
    return calls


def test_register_disabled_installs_nothing(
    installs: list[Settings],
    monkeypatch: pytest.MonkeyPatch,
    log: Log,
) -> None:
    monkeypatch.setenv("TQ_WARMUP", "OFF")
    tq_warmup_plugin.register()
    assert installs == []
    assert log() == [(logging.INFO, "tq-warmup: disabled by TQ_WARMUP")]


def test_register_is_idempotent(installs: list[Settings]) -> None:
    tq_warmup_plugin.register()
    tq_warmup_plugin.register()
    assert installs == [Settings()]


def test_register_warns_once_per_odd_variable_and_uses_the_default(
    installs: list[Settings], monkeypatch: pytest.MonkeyPatch, log: Log
) -> None:
    monkeypatch.setattr(settings, "cpu_count", lambda: 2)
    monkeypatch.setenv("TQ_WARMUP_STRICT", "y")
    monkeypatch.setenv("TQ_WARMUP_THREADS", "99999999999999999999")
    tq_warmup_plugin.register()
    tq_warmup_plugin.register()
    assert installs == [Settings(strict=False, threads=2)]
    assert log() == [
        (
            logging.WARNING,
            "tq-warmup: TQ_WARMUP_STRICT='y' is not one of 1, true, on, yes / 0, false, off, no "
            "(any case): using the default (off)",
        ),
        (
            logging.WARNING,
            "tq-warmup: TQ_WARMUP_THREADS='99999999999999999999' is more than this machine's "
            "2 CPUs: capped at 2 (accepted: a whole number from 1 to 2, this machine's CPU count)",
        ),
    ]


def test_register_warns_about_an_odd_variable_when_disabled_too(
    installs: list[Settings], monkeypatch: pytest.MonkeyPatch, log: Log
) -> None:
    monkeypatch.setenv("TQ_WARMUP", "0")
    monkeypatch.setenv("TQ_WARMUP_REPORT", " ")
    tq_warmup_plugin.register()
    assert installs == []
    assert log() == [
        (
            logging.WARNING,
            "tq-warmup: TQ_WARMUP_REPORT=' ' is blank: no JSON report is written "
            "(accepted: a file path, '{rank}' replaced by the worker's rank)",
        ),
        (logging.INFO, "tq-warmup: disabled by TQ_WARMUP"),
    ]


def test_register_warns_about_a_variable_it_does_not_read(
    installs: list[Settings], monkeypatch: pytest.MonkeyPatch, log: Log
) -> None:
    """Before: ``TQ_WARMUP_STRICT`` misspelt left CI's strict mode off without a word."""
    monkeypatch.setenv("TQ_WARMUP_STRIKT", "1")
    tq_warmup_plugin.register()
    assert installs == [Settings()]
    assert log() == [
        (
            logging.WARNING,
            "tq-warmup: TQ_WARMUP_STRIKT is not a setting of this plugin: ignored "
            "(did you mean TQ_WARMUP_STRICT?)",
        )
    ]


@pytest.mark.parametrize("raw", ["disable", "nope"])
def test_an_odd_tq_warmup_leaves_the_plugin_on_and_says_so(
    installs: list[Settings], monkeypatch: pytest.MonkeyPatch, log: Log, raw: str
) -> None:
    monkeypatch.setenv("TQ_WARMUP", raw)
    tq_warmup_plugin.register()
    assert installs == [Settings()]
    ((level, message),) = log()
    assert level == logging.WARNING
    assert message.startswith(f"tq-warmup: TQ_WARMUP={raw!r} is not one of 1, true, on, yes")


def test_register_imports_nothing_heavy() -> None:
    code = (
        "import sys, tq_warmup_plugin; tq_warmup_plugin.register()\n"
        "from tq_warmup_plugin import install\n"
        "print([m for m in ('torch', 'triton', 'vllm') if m in sys.modules])\n"
        "print(sum(isinstance(f, install._PatchOnImport) for f in sys.meta_path))\n"
    )
    assert fakes.fresh_python(code).split("\n")[:2] == ["[]", "1"]


def boom(worker: Any, settings: Settings) -> Report:
    raise RuntimeError("kaput\nsecond line")


def test_warmup_failure_is_one_warning_and_vllm_still_warms(
    monkeypatch: pytest.MonkeyPatch,
    log: Log,
) -> None:
    monkeypatch.setattr(warmup, "run", boom)
    original = []
    wrapper = install.wrap(lambda worker, **kw: original.append(kw) or "done", Settings())
    assert wrapper(SimpleNamespace(rank=0), process_local_only=True) == "done"
    assert original == [{"process_local_only": True}]
    assert log() == [(logging.WARNING, "tq-warmup: failed: RuntimeError: kaput")]


def test_strict_mode_raises_the_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warmup, "run", boom)
    with pytest.raises(RuntimeError, match="kaput"):
        install.warm_worker(SimpleNamespace(rank=0), Settings(strict=True))


@pytest.mark.parametrize(("strict", "raises"), [(False, False), (True, True)])
def test_errors_warn_and_fail_only_strict_mode(
    monkeypatch: pytest.MonkeyPatch,
    log: Log,
    strict: bool,
    raises: bool,
) -> None:
    report = Report(layers=1, distinct=2, compiled=1, failed=1, errors=["_k: E: x"])
    monkeypatch.setattr(warmup, "run", lambda w, s: report)
    if raises:
        with pytest.raises(RuntimeError, match="strict mode"):
            install.warm_worker(SimpleNamespace(rank=0), Settings(strict=strict))
    else:
        install.warm_worker(SimpleNamespace(rank=0), Settings(strict=strict))
    assert log() == [(logging.WARNING, report.line())]


def test_report_json_per_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, log: Log) -> None:
    report = Report(vllm_version="0.26.0", layers=2, distinct=5, compiled=5)
    monkeypatch.setattr(warmup, "run", lambda w, s: report)
    settings = Settings(report_path=str(tmp_path / "tq-{rank}.json"))
    install.warm_worker(SimpleNamespace(rank=3), settings)
    assert json.loads((tmp_path / "tq-3.json").read_text()) == json.loads(report.to_json())
    assert log() == [(logging.INFO, report.line())]


def test_unwritable_report_only_warns(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, log: Log
) -> None:
    monkeypatch.setattr(warmup, "run", lambda w, s: Report())
    settings = Settings(report_path=str(tmp_path / "missing" / "r.json"))
    install.warm_worker(SimpleNamespace(rank=0), settings)
    levels = [level for level, _ in log()]
    assert levels == [logging.INFO, logging.WARNING]
    assert log()[1][1] == (
        f"tq-warmup: TQ_WARMUP_REPORT={tmp_path}/missing/r.json: the JSON report is not "
        f"written (directory {tmp_path}/missing: No such file or directory)"
    )


UNSUPPORTED = Report(status="unsupported", reason=fakes.OUTSIDE)


def test_declined_release_warns_and_vllm_starts(monkeypatch: pytest.MonkeyPatch, log: Log) -> None:
    monkeypatch.setattr(warmup, "run", lambda w, s: UNSUPPORTED)
    install.warm_worker(SimpleNamespace(rank=0), Settings())
    assert log() == [
        (
            logging.WARNING,
            f"tq-warmup: unsupported: {fakes.OUTSIDE}",
        )
    ]


def test_strict_mode_fails_startup_on_a_declined_release(
    monkeypatch: pytest.MonkeyPatch, log: Log
) -> None:
    monkeypatch.setattr(warmup, "run", lambda w, s: UNSUPPORTED)
    with pytest.raises(RuntimeError) as raised:
        install.warm_worker(SimpleNamespace(rank=0), Settings(strict=True))
    assert str(raised.value) == ("tq-warmup strict mode: tq-warmup: unsupported: " + fakes.OUTSIDE)
    assert log() == [(logging.WARNING, UNSUPPORTED.line())]


@pytest.mark.parametrize("version", [fakes.BEYOND_RELEASE, "0.19.1", None])
def test_strict_mode_fails_startup_on_the_installed_unsupported_release(
    monkeypatch: pytest.MonkeyPatch, log: Log, version: str | None
) -> None:
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: version)
    worker = SimpleNamespace(rank=0)
    install.warm_worker(worker, Settings())
    with pytest.raises(RuntimeError, match=r"^tq-warmup strict mode: tq-warmup: unsupported: "):
        install.warm_worker(worker, Settings(strict=True))
    assert [level for level, _ in log()] == [logging.WARNING, logging.WARNING]


def test_the_readme_says_what_strict_mode_does_on_a_declined_release() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    rows = {row.split("|")[1].strip(): row for row in readme.splitlines() if row.startswith("| ")}
    assert "an unsupported vLLM release fails startup" in rows["`TQ_WARMUP_STRICT`"]
    line = Report(
        status="unsupported",
        reason=compat.support_problem(compat.parse_version(fakes.BEYOND)) or "",
    ).line()
    # The README states the range as released; a bump changes it with NEWEST.
    shown = line.replace(fakes.BEYOND, "X.Y").replace(compat.SUPPORTED, "RANGE")
    assert re.search(
        re.escape(f"`{shown}` (WARNING)").replace("RANGE", r"\d+\.\d+-\d+\.\d+"), rows["other"]
    )
    assert "with `TQ_WARMUP_STRICT=1` startup fails instead" in rows["other"]


def test_no_layers_informs_even_in_strict_mode(monkeypatch: pytest.MonkeyPatch, log: Log) -> None:
    report = Report(status="skipped", reason="no TurboQuant attention layers in this worker")
    monkeypatch.setattr(warmup, "run", lambda w, s: report)
    install.warm_worker(SimpleNamespace(rank=0), Settings(strict=True))  # not a failure
    assert log() == [(logging.INFO, report.line())]


def test_swapped_marks_its_stand_ins_and_puts_back_what_was_there() -> None:
    """The one patch-for-a-block helper (``patching.swapped``, as the fused MoE steps use
    it on vLLM's ops module in a live worker): each stand-in is marked with what it
    replaced, and on the way out, even on an exception, the module holds its own
    function again and a class the method it inherited."""
    from tq_warmup_plugin import patching

    def device_name() -> str:
        return "H200"

    module = types.ModuleType("ops")
    module.device_name = device_name  # type: ignore[attr-defined]

    class Base:
        def count(self) -> int:
            return 1

    class Platform(Base):
        pass

    with pytest.raises(RuntimeError), patching.swapped(module, {"device_name": lambda: "B200"}):
        assert module.device_name() == "B200"
        assert patching.original_of(module.device_name) is device_name
        raise RuntimeError
    assert module.device_name is device_name
    with patching.swapped(Platform, {"count": lambda self: 7}):
        assert Platform().count() == 7 and patching.is_ours(Platform.__dict__["count"])
    assert "count" not in Platform.__dict__ and Platform().count() == 1
