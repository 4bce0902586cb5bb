#!/usr/bin/env bash
# Usage: .ci/vllm-env.sh VLLM_VERSION TRITON_VERSION DIR
# Builds a CPU-only venv at DIR with torch 2.13.0+cpu, the given triton, the extra
# modules vLLM needs to import its TurboQuant code, `vllm==VERSION --no-deps`, and the
# test tools. Idempotent: skipped when DIR/.ok-VERSION exists and matches this recipe.
# Installs with uv (\$UV, else the uv on PATH, else uv installed into DIR by pip), which reads
# neither pip's config nor its variables: pip's find-links and extra index URLs are passed to it.
# The venv keeps pip for later installs into it. uv's cache is shared by every release's venv.
# vLLM imports on a CPU host once its module-level imports are met; never `pip install vllm`
# without --no-deps (it would pull CUDA torch and pin versions this venv does not want).
set -euo pipefail
if [[ $# -ne 3 ]]; then echo "usage: $0 VLLM_VERSION TRITON_VERSION DIR" >&2; exit 2; fi
VERSION=$1 TRITON=$2 DIR=$3
PYTHON=${PYTHON:-python3}
start=$SECONDS

# The marker holds a hash of this script and its inputs: editing the recipe rebuilds the venv.
STAMP="$(cat "$0" "$(dirname "$0")/constraints.txt" | sha256sum | cut -c1-16) triton=$TRITON"
if [[ -f "$DIR/.ok-$VERSION" && "$(cat "$DIR/.ok-$VERSION")" == "$STAMP" ]]; then
  echo "vllm-env: $DIR already has vllm $VERSION (remove $DIR/.ok-$VERSION to rebuild)"
  exit 0
fi

# torch 2.11.0 (the pin of vLLM 0.20-0.26) has no CPU wheel here; every release uses the
# local torch 2.13.0+cpu wheel with the release's own triton.
TORCH=torch==2.13.0+cpu  # the local version: never a CUDA build of 2.13.0

# Modules vLLM imports at module level but that --no-deps leaves out (found with the
# import loop of the recipe). Same list for 0.26.0 and 0.33.0; 0.26.0 only needs
# transformers>=5.5.3 and xgrammar>=0.2.1,<1, which these pins satisfy.
EXTRAS=(
  numpy packaging regex "pydantic>=2.12.0" cbor2 psutil pyzmq urllib3
  "transformers>=5.16.1,<5.20.0" aiohttp requests openai pillow pybase64
  cachetools msgspec cloudpickle uvloop py-cpuinfo prometheus_client "xgrammar==0.2.8"
  "fastapi>=0.133.0,<0.137.0" partial_json_parser "llguidance>=1.7.0,<1.8.0" einops
  gguf  # imported at module level by 0.20-0.22 (vllm/transformers_utils/gguf_utils.py)
)
# The `openai_harmony` module comes from a distribution that changed between releases:
# vLLM 0.26.0 requires openai-harmony>=0.0.3, 0.33.0 requires oss-harmony>=0.0.11 (a fork
# that ships the same module name, so never install both). Taken from vLLM's own metadata below.
TEST_TOOLS=(pytest pytest-xdist hypothesis pluggy)

if [[ -e "$DIR" ]]; then
  if [[ -f "$DIR/pyvenv.cfg" ]]; then
    echo "vllm-env: removing incomplete venv $DIR"; rm -rf "$DIR"
  elif [[ -n "$(ls -A "$DIR")" ]]; then
    echo "vllm-env: $DIR exists and is not a venv; refusing to touch it" >&2; exit 1
  fi
fi
"$PYTHON" -m venv "$DIR"
if [[ -z "${UV:-}" ]]; then
  UV=$(command -v uv || true)
  if [[ -z "$UV" ]]; then
    "$DIR/bin/python" -m pip --disable-pip-version-check --no-input install -q "uv>=0.5"
    UV=$DIR/bin/uv
  fi
fi
# pip's own settings (its config files and PIP_* variables) as uv flags: find-links and extra
# indexes; a file:// index that does not exist is left out (pip warns and goes on, uv fails).
mapfile -t PIP_SOURCES < <("$DIR/bin/python" -m pip config list 2>/dev/null | python3 -c '
import os, sys
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    flag = {"find-links": "--find-links", "extra-index-url": "--extra-index-url",
            "index-url": "--default-index"}.get(key.rpartition(".")[2])
    for item in value.strip("\x27\"").split() if flag else ():
        if not item.startswith("file:") or os.path.exists(item.removeprefix("file://")):
            print(flag); print(item)
')
UV_PIP=("$UV" pip install --python "$DIR/bin/python" --no-progress --index-strategy unsafe-best-match
        "${PIP_SOURCES[@]}")
CONSTRAINTS=(-c "$(cd "$(dirname "$0")" && pwd)/constraints.txt")
"${UV_PIP[@]}" "${CONSTRAINTS[@]}" --no-deps "vllm==$VERSION"
HARMONY=$("$DIR/bin/python" - <<'PY'
import importlib.metadata as md, re
reqs = [r.split(";")[0].strip() for r in md.requires("vllm") or []]
print(next(r for r in reqs if re.match(r"(openai|oss)[-_]harmony\b", r, re.I)))
PY
)
echo "vllm-env: vllm $VERSION wants $HARMONY"
# compressed-tensors, at vLLM's own pin: Qwen3-Next's model class imports vLLM's quantization
# code, which imports it, so without it vLLM cannot inspect that model and its tests skip.
COMPRESSED=$("$DIR/bin/python" - <<'PY'
import importlib.metadata as md
reqs = [r.split(";")[0].strip() for r in md.requires("vllm") or []]
print(next(r for r in reqs if r.startswith("compressed-tensors")))
PY
)
# torch in the same command as the extras: otherwise xgrammar's torch>=1.10 resolves to CUDA torch.
"${UV_PIP[@]}" "${CONSTRAINTS[@]}" "$TORCH" "triton==$TRITON" "${EXTRAS[@]}" "$HARMONY" \
  "$COMPRESSED" "${TEST_TOOLS[@]}"
"$DIR/bin/python" - "$VERSION" "$TRITON" <<'PY'
import sys, importlib.metadata as md
want = {"vllm": sys.argv[1], "triton": sys.argv[2], "torch": "2.13.0+cpu"}
got = {k: md.version(k) for k in want}
bad = {k: (got[k], v) for k, v in want.items() if got[k] != v}
if bad:
    sys.exit(f"vllm-env: wrong versions installed (got, want): {bad}")
print("vllm-env: versions", got)
PY
echo "$STAMP" > "$DIR/.ok-$VERSION"
echo "vllm-env: built $DIR (vllm $VERSION, triton $TRITON) in $((SECONDS - start)) s"
