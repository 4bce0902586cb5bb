"""Version parsing, the supported range, and the per-release feature gates."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fakes
import pytest

from tq_warmup_plugin import compat
from tq_warmup_plugin.plan import model as plan_model
from tq_warmup_plugin.plan import request as plan_request
from tq_warmup_plugin.plan import rules as plan_rules


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("0.26.0", (0, 26)),
        ("0.26.1rc1.dev3+gabc", (0, 26)),
        (" 0.33.2", (0, 33)),
        ("1.0", (1, 0)),
        ("", None),
        (None, None),
        ("garbage", None),
        ("v0.26.0", None),
    ],
)
def test_parse_version(text: str | None, version: compat.Version | None) -> None:
    assert compat.parse_version(text) == version


@pytest.mark.parametrize("version", [(0, 20), (0, 26), (0, 33)])
def test_supported_releases(version: compat.Version) -> None:
    assert compat.support_problem(version) is None


@pytest.mark.parametrize(
    ("version", "shown"),
    [((0, 19), "0.19"), ((compat.NEWEST[0], compat.NEWEST[1] + 1), fakes.BEYOND), ((1, 0), "1.0")],
)
def test_unsupported_release_is_one_line_naming_the_range(
    version: compat.Version, shown: str
) -> None:
    problem = compat.support_problem(version)
    assert problem is not None and "\n" not in problem
    assert shown in problem and compat.SUPPORTED in problem


def test_unknown_version_is_a_problem() -> None:
    assert compat.support_problem(None) == "cannot determine the installed vLLM version"


# Every gate of compat.Features, in field order: a new gate fails this test until
# its column is added here.
GATE_COLUMNS = (
    "kv_view_transposed",
    "kv_head_major",
    "stage2_output_fp16",
    "continuation_seq_lens_sliced",
    "uses_workspace",
    "unrotate_fp16",
    "spec_graphs_unsafe",
    "spec_verify_batched",
    "v1_tq_cache_dtype_lost",
    "prefill_buffers_cached",
    "draft_cpu_seq_lens_stale",
    "v2_ubatches",
    "v2_draft_prefill_kernel",
    "rocm_flydsl",
    "local_boundary_tq_backend",
    "local_tq_spec_plain",
    "prefix_fast_path_unsafe",
    "prefill_host_copies",
    "local_prefill_real_lens",
    "registry_warms_slot_mapping",
    "v2_top_k_top_p_model_dtype",
    "registry_warms_rejection_sampler",
    "registry_warms_eagle_helpers",
    "jit_registry_collects",
    "hybrid_turboquant",
    "tq_block_aligned",
    "tq_page_packed",
    "v1_block_table_aligned",
    "block_table_rounded",
    "v2_runner_default",
    "draft_slot_in_threshold",
    "kv_transient_window",
    "v1_runner",
)
T, F = True, False
# fmt: off
GATES = {
    (0, 20): (F,F,F,F,F,F,T,F,F,F,F,F,F,F,T,T,T,F,F,F,F,F,F,F,F,F,F,F,F,F,F,F,T),
    (0, 21): (F,F,T,T,T,T,T,T,F,T,T,F,F,F,T,T,T,T,T,F,F,F,F,F,T,F,F,T,F,F,F,F,T),
    (0, 23): (F,F,T,T,T,T,T,T,F,T,T,F,F,F,T,T,T,T,T,F,F,F,F,F,T,F,F,T,F,F,F,F,T),
    (0, 24): (F,F,T,T,T,T,T,T,F,T,T,F,F,F,T,T,T,T,T,F,F,F,F,F,T,F,F,T,F,F,F,F,T),
    (0, 25): (F,F,T,T,T,T,T,T,T,T,T,F,F,F,T,T,T,T,T,F,F,F,F,F,T,T,F,T,F,T,F,F,T),
    (0, 26): (T,T,T,T,T,T,T,T,T,T,T,F,F,F,T,T,T,T,T,F,T,F,F,F,T,T,F,T,F,T,F,F,T),
    (0, 28): (T,T,T,T,T,T,T,T,F,T,T,F,F,T,T,F,T,T,T,F,F,F,F,F,T,T,T,T,T,T,F,F,T),
    (0, 29): (T,F,T,T,T,T,T,T,F,T,T,F,F,T,T,F,T,T,T,T,F,F,F,T,T,T,T,T,T,T,F,F,T),
    (0, 30): (T,F,T,T,T,T,T,T,F,T,T,T,F,T,T,F,T,T,F,T,F,T,T,T,T,T,T,T,T,T,F,F,T),
    (0, 33): (T,F,T,T,T,T,T,T,F,T,T,T,T,T,T,F,T,T,F,T,F,T,T,T,T,T,T,T,T,T,F,F,T),
    (0, 34): (T,F,T,T,T,T,T,T,F,T,F,T,T,T,T,F,T,T,F,T,F,T,T,T,T,T,T,T,T,T,T,T,F),
}
# fmt: on


def test_a_release_bump_rejudges_every_gate_that_would_end_under_it() -> None:
    """Moving ``NEWEST`` past a gate's last release turns that guard off for the new
    release; this fails, naming each such gate, until it is extended to the new release
    (the bug is still there) or named in ``JUDGED_ENDINGS`` (fixed upstream), and until
    the README's release table says the new range."""
    ending = compat.gates_ending_at_newest()
    newest = f"{compat.NEWEST[0]}.{compat.NEWEST[1]}"
    problems = []
    if ending:
        problems.append(
            f"re-judge on it the gates that end with the release before: {', '.join(ending)} "
            "(extend each, or name it in compat.JUDGED_ENDINGS with the release that fixed "
            'it), then read the statements that say "all releases" again in its wheel '
            '(grep -rn "all releases" src)'
        )
    if f"outside the supported releases {compat.SUPPORTED}`" not in README.read_text():
        problems.append(f"give the README's release table a {newest} row and the range")
    assert not problems, f"NEWEST is {newest}: " + "; ".join(problems)


REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".awk", ".txt", ""}


def _repo_texts() -> list[Path]:
    """The repository's own text files: source, tests, benchmarks (not raw runs), docs,
    deploy files and CI; nothing built or cached."""
    roots = [REPO / d for d in ("src", "tests", "benchmarks", "docs", "deploy", ".ci")]
    files = [README, REPO / "pyproject.toml"]
    for root in roots:
        files += [
            p
            for p in root.rglob("*")
            if p.is_file()
            and p.suffix in TEXT_SUFFIXES
            and not {"__pycache__", "raw"} & set(p.relative_to(REPO).parts)
            and not any(part.endswith(".egg-info") for part in p.parts)
        ]
    return files


def test_the_supported_range_is_stated_in_compat_alone() -> None:
    """A release bump is one edit (``NEWEST``): no other file states the supported range,
    so none goes stale in silence. The README's is the warning it quotes, which the
    release-bump test above checks against ``compat.SUPPORTED``."""
    ranges = {compat.SUPPORTED, f"{compat.OLDEST[0]}.{compat.OLDEST[1]}.0-{compat.NEWEST[0]}."}
    releases = REPO / "src" / "tq_warmup_plugin" / "compat" / "releases.py"
    stating = [
        str(p.relative_to(REPO))
        for p in _repo_texts()
        if p not in (releases, README) and any(r in p.read_text(errors="replace") for r in ranges)
    ]
    assert stating == [], f"state the range only in compat/releases.py: {stating}"


def test_the_bump_check_sees_a_gate_that_ends_and_one_judged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    last = max(m for m in range(20, 100) if compat.features((0, m)).spec_graphs_unsafe)
    beyond = (0, last + 1)
    ending = compat.gates_ending_at_newest(beyond)  # NEWEST moved past it, not re-judged
    assert "spec_graphs_unsafe" in ending
    assert "v1_tq_cache_dtype_lost" not in ending  # ended at 0.26, long before
    monkeypatch.setitem(compat.JUDGED_ENDINGS, "spec_graphs_unsafe", beyond)
    assert "spec_graphs_unsafe" not in compat.gates_ending_at_newest(beyond)


def test_gate_table_names_every_gate() -> None:
    assert compat.Features._fields == ("version", *GATE_COLUMNS)


@pytest.mark.parametrize(("version", "gates"), GATES.items())
def test_feature_gates(version: compat.Version, gates: tuple[bool, ...]) -> None:
    f = compat.features(version)
    assert f.version == version
    assert dict(zip(GATE_COLUMNS, f[1:], strict=True)) == dict(
        zip(GATE_COLUMNS, gates, strict=True)
    )


@pytest.mark.parametrize(
    ("version", "strides"),
    # 16 tokens per block, 2 KV heads, 134-byte slots (turboquant_4bit_nc, d=128)
    [
        ((0, 25), (4288, 268, 134)),
        ((0, 26), (4288, 134, 2144)),
        ((0, 28), (4288, 134, 2144)),
        ((0, 29), (4288, 268, 134)),
    ],
)
def test_kv_view_strides(version: compat.Version, strides: tuple[int, int, int]) -> None:
    assert plan_rules.kv_view_strides(compat.features(version), 16, 2, 134) == strides


@pytest.mark.parametrize(
    ("capability", "flag"),
    [(None, 0), ((8, 0), 1), ((8, 6), 1), ((8, 9), 0), ((9, 0), 0), ((10, 0), 0)],
)
def test_fp8_e4b15(capability: tuple[int, int] | None, flag: int) -> None:
    assert compat.fp8_e4b15(capability) == flag


# A fresh process that records every attempt to import a vllm module (found or
# not, so it also works without vLLM installed) around one compat.workspace_manager
# call; argv[2] == "block" refuses those imports (importing vLLM takes ~15 s here).
_IMPORT_SPY = """
import json, sys
tried = []

class Spy:
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "vllm":
            tried.append(name)
            if sys.argv[2] == "block":
                raise ModuleNotFoundError(name)

sys.meta_path.insert(0, Spy())
from tq_warmup_plugin import compat

try:
    result = repr(compat.workspace_manager(compat.features(tuple(json.loads(sys.argv[1])))))
except ImportError as exc:
    result = type(exc).__name__
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "vllm")
print(json.dumps({"result": result, "tried": sorted(set(tried)), "loaded": loaded}))
"""


def _workspace_manager_in_a_fresh_process(
    version: compat.Version, block: bool = False
) -> dict[str, Any]:
    src = str(Path(compat.__file__).parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_SPY, json.dumps(version), "block" if block else "-"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_workspace_manager_is_none_where_unused_without_importing_vllm() -> None:
    assert _workspace_manager_in_a_fresh_process((0, 20)) == {
        "result": "None",
        "tried": [],
        "loaded": [],
    }
    # The spy sees the import where the workspace is used (0.21+).
    assert _workspace_manager_in_a_fresh_process((0, 21), block=True) == {
        "result": "ModuleNotFoundError",
        "tried": ["vllm"],
        "loaded": [],
    }


@pytest.mark.real_vllm
def test_every_call_site_binds_the_defining_modules_kernel_warmup(
    vllm_env: compat.Features,
) -> None:
    """``install`` rebinds, and ``uninstall`` restores, exactly ``CALL_SITE_MODULES``: the
    defining module and each module that imports ``kernel_warmup`` by name (elastic EP
    from 0.27 on)."""
    defining = importlib.import_module(compat.WARMUP_MODULE)
    assert defining.kernel_warmup.__module__ == compat.WARMUP_MODULE
    assert compat.CALL_SITE_MODULES[0] == compat.WARMUP_MODULE
    for name in compat.CALL_SITE_MODULES[1:]:
        module = importlib.import_module(name) if importlib.util.find_spec(name) else None
        if name == compat.ELASTIC_MODULE and vllm_env.version < (0, 27):
            assert not hasattr(module, "kernel_warmup")  # 0.26 has the module, not the call
            continue
        assert getattr(module, "kernel_warmup", None) is defining.kernel_warmup, name


@pytest.mark.real_vllm
@pytest.mark.parametrize(("name", "module"), compat.KERNEL_MODULES.items())
def test_every_kernel_module_is_a_known_vllm_module(
    vllm_env: compat.Features, name: str, module: str
) -> None:
    """Each module imports and defines (not re-exports) that Triton kernel."""
    from triton.runtime.jit import JITFunction

    kernel = getattr(importlib.import_module(module), name)
    assert isinstance(kernel, JITFunction)
    assert (kernel.fn.__name__, kernel.fn.__module__) == (name, module)
    assert compat.kernel_function(name) is kernel


@pytest.mark.parametrize(
    ("version", "bs", "v2", "width"),
    [
        ((0, 26), 16, True, 64),
        ((0, 26), 16, False, 64),
        ((0, 22), 48, False, 22),
        ((0, 20), 16, False, 63),
        ((0, 27), 16, False, 64),
        ((0, 33), 48, False, 24),
        ((0, 33), 256, True, 4),
        ((0, 20), 128, True, 8),
    ],
)
def test_block_table_width_for_1000_tokens(
    version: compat.Version, bs: int, v2: bool, width: int
) -> None:
    assert plan_rules.block_table_width(compat.features(version), 1000, bs, v2) == width


def _version_comparisons(source: str) -> list[int]:
    """Lines that compare something to a release tuple such as ``(0, 25)``."""

    def is_release(node: ast.expr) -> bool:
        return (
            isinstance(node, ast.Tuple)
            and len(node.elts) == 2
            and all(isinstance(e, ast.Constant) and isinstance(e.value, int) for e in node.elts)
        )

    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Compare)
        and not all(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops)
        and any(is_release(side) for side in (node.left, *node.comparators))
    ]


def test_every_version_comparison_lives_in_the_release_table() -> None:
    """A release's behaviour is decided in ``compat.features()`` alone: a comparison
    with a release elsewhere is a gate the release-bump test cannot see."""
    package = REPO / "src" / "tq_warmup_plugin"
    found = {
        str(p.relative_to(package)): lines
        for p in package.rglob("*.py")
        if p.parent.name != "compat" and (lines := _version_comparisons(p.read_text()))
    }
    assert found == {}, f"move these release comparisons into compat.Features: {found}"
    assert _version_comparisons("ok = feats.version >= (0, 27)\n") == [1]  # it sees one


@pytest.mark.parametrize(
    ("version", "block", "width"),
    [
        ("0.24.0", 16, 64),
        ("0.26.0", 32, 32),
    ],  # ceil(900 / 16) -> x8 (V1), ceil(900 / 32) -> x4 (V2)
)
def test_a_plan_request_from_flags_alone_reads_no_environment(
    version: str, block: int, width: int
) -> None:
    """Planning is a function of its request: no argparse namespace, no environment
    read or written (the CLI sets ``HF_HUB_OFFLINE`` at its edge)."""
    before = dict(os.environ)
    request = plan_request.PlanRequest(
        kv_cache_dtype="turboquant_4bit_nc",
        vllm_version=version,
        head_size=128,
        num_heads=32,
        num_kv_heads=8,
        tensor_parallel_size=2,
        max_model_len=900,
    )
    planned = plan_request.plan_geometry(request, None)
    assert dict(os.environ) == before
    g = planned.geometry
    assert (g.num_heads, g.num_kv_heads, g.block_size) == (16, 4, block)
    assert g.block_table_width == width  # the release's default runner's table
    assert planned.note == "from flags"


def test_the_kernel_block_is_the_block_where_vllm_cannot_say(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A release without ``select_common_block_size`` (or no vLLM): the manager's block, a
    # guess whose miss costs a compile (the real choice: tests/contract/test_contract_hybrid_block).
    monkeypatch.setattr(compat.vllm_paths, "WORKER_UTILS_MODULE", "tq_no_such_module")
    assert compat.kernel_block_size(2160) == 2160


def test_a_hybrid_vllm_cannot_size_is_planned_at_its_block_with_one_line() -> None:
    """Where vLLM cannot size a hybrid's block (here: no vLLM, or a model it cannot read),
    the plan keeps the block it was given and its note says why in one line."""
    shape = plan_model.ModelShape(
        architecture="HybridForCausalLM", head_size=128, total_heads=16, total_kv_heads=2,
        num_heads=16, num_kv_heads=2, num_layers=8, attention_layers=(3, 7), hybrid=True,
        dtype="bfloat16", config_dtype="bfloat16", max_model_len=4096, scale=None,
        config=object(),
    )  # fmt: skip
    with pytest.raises(compat.CompatError, match="could not size the hybrid block"):
        compat.hybrid_block_size(object(), 1, "turboquant_4bit_nc", 16, 0)
    request = plan_request.PlanRequest(kv_cache_dtype="turboquant_4bit_nc", vllm_version="0.26.0")
    planned = plan_request.plan_shape(request, shape)
    assert planned.geometry.block_size == 16  # no boundary layers: not TurboQuant's 32
    assert "; hybrid: block 16 (vLLM could not size the hybrid block: " in planned.note
    assert planned.note.endswith("--geometry-json is exact") and "\n" not in planned.note
    assert "Error(" not in planned.note  # the exception's name and words, not its repr


@pytest.mark.parametrize(
    ("version", "beyond"),
    [((compat.NEWEST[0], compat.NEWEST[1] + 1), True), ((1, 0), True), (compat.NEWEST, False),
     (compat.OLDEST, False), ((0, 19), False), (None, False)],
)  # fmt: skip
def test_beyond_newest_is_a_release_after_the_ones_read(
    version: tuple[int, int] | None, beyond: bool
) -> None:
    assert compat.beyond_newest(version) is beyond


@pytest.mark.parametrize(
    ("version", "attr", "v2"),
    [((0, 33), False, False), ((0, 33), True, True), ((0, 34), None, True)],
)
def test_a_worker_runs_v2_where_v1_is_gone(
    version: compat.Version, attr: bool | None, v2: bool
) -> None:
    """0.34 removed ``Worker.use_v2_model_runner`` with the V1 runner: its workers run V2."""
    worker = SimpleNamespace() if attr is None else SimpleNamespace(use_v2_model_runner=attr)
    assert compat.worker_uses_v2(worker, compat.features(version)) is v2


@pytest.mark.parametrize(
    ("version", "method", "rows"),
    [((0, 33), "draft_model", 4), ((0, 34), "draft_model", 5), ((0, 34), "ngram", 4)],
)
def test_the_planned_verify_rows_count_the_draft_models_correction_token(
    version: compat.Version, method: str, rows: int
) -> None:
    """0.34's ``max_decode_query_len`` is ``1 + k + max_num_new_slots_for_drafting``: one
    more for draft_model's correction token (k = 3 here)."""
    assert plan_rules.verify_len(compat.features(version), 3, False, method) == rows


def test_a_v1_runner_is_refused_where_the_release_has_none() -> None:
    request = plan_request.PlanRequest(
        kv_cache_dtype="turboquant_4bit_nc", head_size=128, num_heads=8, num_kv_heads=2,
        vllm_version="0.34.0", runner="v1",
    )  # fmt: skip
    with pytest.raises(plan_request.PlanError, match=r"^--runner v1: vLLM 0.34 has no V1 model"):
        plan_request.plan_geometry(request, None)
    assert plan_request.plan_geometry(dataclasses.replace(request, runner="v2"), None).geometry


def test_no_libcuda_is_our_line_not_tritons(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.6 asserts "libcuda.so cannot found!" on a host without the driver; the
    precompile line says it in the plugin's words."""
    from tq_warmup_plugin.compat import triton as compat_triton

    def no_driver() -> list[str]:
        raise AssertionError("libcuda.so cannot found!\nPossible files are located at []")

    driver = SimpleNamespace(make_launcher=object(), library_dirs=no_driver)
    monkeypatch.setitem(sys.modules, "triton.backends.nvidia.driver", driver)
    monkeypatch.setattr(compat_triton, "_no_launchers", [])
    kernel = SimpleNamespace(metadata=SimpleNamespace(target=SimpleNamespace(backend="cuda")))
    why = compat_triton.build_host_launcher(kernel)
    assert why is not None and why.startswith("libcuda.so.1 not found")
    assert "cannot found" not in why and compat_triton.no_launchers_why() == why
