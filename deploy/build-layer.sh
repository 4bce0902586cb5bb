#!/usr/bin/env bash
# Builds the read-only Triton cache layer on a CPU machine: the Containerfile's builder stage
# RUNs this verbatim; it runs the same on a plain host. Settings (environment):
#   VLLM_VERSION, TRITON_VERSION  the image's vLLM and Triton releases (required)
#   IMAGE_PYTHON    the image's Python (3.12 for vllm/vllm-openai): Triton's keys hash its build
#   MODEL           directory with the model's config.json          (default /model)
#   KV_CACHE_DTYPES space-separated TurboQuant presets              (default turboquant_4bit_nc)
#   PRECOMPILE_ARGS the server's other settings, e.g. "--max-model-len 8192 -tp 2"
#   ARCH (90), CACHE (/opt/tq-warmup/cache), VENV (/opt/tq-warmup/venv), DIST (/opt/tq-warmup/dist)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
: "${VLLM_VERSION:?}" "${TRITON_VERSION:?}"
IMAGE_PYTHON=${IMAGE_PYTHON:-3.12} MODEL=${MODEL:-/model} ARCH=${ARCH:-90}
KV_CACHE_DTYPES=${KV_CACHE_DTYPES:-turboquant_4bit_nc} PRECOMPILE_ARGS=${PRECOMPILE_ARGS:-}
CACHE=${CACHE:-/opt/tq-warmup/cache} VENV=${VENV:-/opt/tq-warmup/venv} DIST=${DIST:-/opt/tq-warmup/dist}
start=$SECONDS

# 1. A CPU venv with the image's vLLM (kernel sources) and Triton, vLLM's pins untouched:
#    the recipe CI uses (CPU torch; `pip install vllm` would pull the CUDA one).
"$REPO/.ci/vllm-env.sh" "$VLLM_VERSION" "$TRITON_VERSION" "$VENV"
# 2. The plugin, as a wheel the server image installs too.
"$VENV/bin/python" -m pip wheel --no-deps -w "$DIST" "$REPO"
"$VENV/bin/python" -m pip install --no-deps --force-reinstall "$DIST"/tq_warmup_plugin-*.whl
# 3. The image's Triton wheel: the cache keys are computed for that build.
wheels=$(mktemp -d)
"$VENV/bin/python" -m pip download -q --no-deps --only-binary=:all: \
  --python-version "$IMAGE_PYTHON" -d "$wheels" "triton==$TRITON_VERSION"
# 4. Compile every kernel startup will warm, for the GPU, into the layer.
for dtype in $KV_CACHE_DTYPES; do
  # shellcheck disable=SC2086  # PRECOMPILE_ARGS is a list of flags
  "$VENV/bin/tq-warmup" precompile --model "$MODEL" --kv-cache-dtype "$dtype" --arch "$ARCH" \
    --image-vllm "$VLLM_VERSION" --image-triton-wheel "$wheels"/triton-*.whl \
    --cache-dir "$CACHE" $PRECOMPILE_ARGS
done
# 5. Check the layer offline against its manifests (exit 1 on a problem), for the image's
#    Triton build and Python, not this host's.
"$VENV/bin/tq-warmup" verify --cache-dir "$CACHE" --arch "$ARCH" \
  --image-triton-wheel "$wheels"/triton-*.whl
rm -rf "$wheels"
echo "build-layer: $CACHE $(du -sh "$CACHE" | cut -f1), $(find "$CACHE" -name '*.cubin' | wc -l) cubins, $((SECONDS - start)) s"
