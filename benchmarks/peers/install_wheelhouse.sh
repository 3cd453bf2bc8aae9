#!/usr/bin/env bash
# On the offline GPU machine: put the wheels of .peer-wheels/ (built by build_wheelhouse.sh) back together,
# check them against SHA256SUMS and install them with `pip install --no-deps --no-index --target DIR`, so
# that nothing vLLM declares (torch, nvidia-*, flashinfer 0.6.12, ...) is installed or can shadow the
# machine's torch. Then it prints what it installed and, unless PEER_IMPORT_CHECK=0, imports vLLM's
# serve/LLM/engine/worker/FA3 modules to prove the set is complete (that loads vLLM's CUDA extensions).
#
#   benchmarks/peers/install_wheelhouse.sh DIR [EXTRA_WHEEL_DIR ...]
#
# EXTRA_WHEEL_DIR: more wheels to install into DIR, e.g. .gpu-bundle/whl; a wheel whose project is already
# in .peer-wheels is skipped. With the bundle's wheels inside DIR, vLLM runs on PYTHONPATH=DIR alone and
# never sees the bundle's flashinfer (the recommended "isolated" set-up, see NOTES-deps.md).
# Without it, run vLLM with PYTHONPATH=DIR:/tmp/site (after `source .gpu-bundle/activate`).
# The import check uses PYTHONPATH=DIR plus whatever PYTHONPATH is already set.
#
# Environment: PEER_WHEELS_DIR (default <repo>/.peer-wheels), PYTHON (default python3), PEER_IMPORT_CHECK=0.
set -euo pipefail

[ $# -ge 1 ] || { sed -n '2,15p' "$0" >&2; exit 2; }
dest=$1; shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
wh=${PEER_WHEELS_DIR:-$root/.peer-wheels}
py=${PYTHON:-python3}
[ -f "$wh/SHA256SUMS" ] || { echo "error: $wh/SHA256SUMS not found (run build_wheelhouse.sh where pip works)" >&2; exit 1; }

work=$(mktemp -d /tmp/peer-wheels.XXXXXX)
trap 'rm -rf "$work"' EXIT

# 1. whole wheels as they are, split ones re-assembled (parts sort as aa, ab, ...)
shopt -s nullglob
for f in "$wh"/*.whl; do ln -s "$f" "$work/"; done
for first in "$wh"/*.whl.part-aa; do
  base=${first%.part-aa}
  cat "$base".part-* > "$work/$(basename "$base")"
done

# 2. every wheel in SHA256SUMS present and intact, and nothing else
( cd "$work" && sha256sum --check --quiet --strict "$wh/SHA256SUMS" ) || { echo "error: checksum mismatch" >&2; exit 1; }
mapfile -t peer < <(awk '{print $2}' "$wh/SHA256SUMS")
[ "$(ls "$work" | wc -l)" -eq "${#peer[@]}" ] || { echo "error: .peer-wheels holds wheels not in SHA256SUMS" >&2; exit 1; }
echo "checked ${#peer[@]} wheels against SHA256SUMS"

norm() { basename "$1" | cut -d- -f1 | tr 'A-Z.-' 'a-z__'; }
declare -A have=()
files=()
for w in "${peer[@]}"; do have[$(norm "$w")]=1; files+=("$work/$w"); done
for d in "$@"; do
  for w in "$d"/*.whl; do
    n=$(norm "$w")
    if [ -n "${have[$n]:-}" ]; then echo "skip $(basename "$w") (in .peer-wheels)"; continue; fi
    have[$n]=1; files+=("$w")
  done
done

# 3. install: no dependency resolution, no index, into DIR only
mkdir -p "$dest"
PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore "$py" -m pip install -q --no-deps --no-index \
  --no-compile --no-cache-dir --upgrade --target "$dest" "${files[@]}"
dest=$(cd "$dest" && pwd)
echo "installed into $dest:"
for d in "$dest"/*.dist-info; do b=$(basename "$d" .dist-info); echo "  ${b%-*}==${b##*-}"; done
echo "  ($(du -sh "$dest" | cut -f1) on disk; console script: $dest/bin/vllm, or python3 -m vllm.entrypoints.cli.main)"

[ "${PEER_IMPORT_CHECK:-1}" = 0 ] && exit 0

# 4. import check
echo "import check with PYTHONPATH=$dest${PYTHONPATH:+:$PYTHONPATH}"
PYTHONPATH="$dest${PYTHONPATH:+:$PYTHONPATH}" "$py" - <<'PY'
import importlib, importlib.util, os, sys, time
t0 = time.time()
need = """cachetools cbor2 llguidance openai distro openai_harmony partial_json_parser pybase64 watchfiles
  model_hosting_container_standards jmespath prometheus_fastapi_instrumentator
  fastapi starlette uvicorn pydantic pydantic_core zmq msgspec xgrammar sniffio anyio httpx aiohttp
  transformers tokenizers safetensors torch triton numpy psutil cpuinfo prometheus_client cloudpickle
  einops PIL yaml regex requests tqdm filelock jinja2 huggingface_hub uvloop""".split()
bad = []
for m in need:
    try:
        importlib.import_module(m)
    except Exception as e:
        bad.append(f"{m}: {e!r}")
import torch, vllm
print(f"vllm {vllm.__version__} ({os.path.dirname(vllm.__file__)}), torch {torch.__version__}, "
      f"python {sys.version.split()[0]}")
if not torch.__version__.startswith("2.11.0"):
    bad.append(f"torch {torch.__version__}: vllm 0.24.0's extensions are built for torch 2.11.0")
for m in ["vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main", "vllm.entrypoints.llm",
          "vllm.v1.engine.core", "vllm.v1.engine.async_llm", "vllm.v1.worker.gpu_worker",
          "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner",
          "vllm.model_executor.models.llama", "vllm.model_executor.model_loader.dummy_loader",
          "vllm.v1.attention.backends.flash_attn", "vllm.v1.sample.sampler",
          "vllm.entrypoints.serve.instrumentator.metrics"]:
    try:
        importlib.import_module(m)
    except Exception as e:
        bad.append(f"{m}: {e!r}")
try:
    from vllm.vllm_flash_attn import flash_attn_interface as fa
    print(f"vllm_flash_attn: FA2 {fa.FA2_AVAILABLE}, FA3 {fa.FA3_AVAILABLE}"
          + ("" if fa.FA3_AVAILABLE else f" ({fa.FA3_UNAVAILABLE_REASON})"))
    if not fa.FA3_AVAILABLE:
        bad.append("FA3 extension did not load")
except Exception as e:
    bad.append(f"vllm.vllm_flash_attn: {e!r}")
spec = importlib.util.find_spec("flashinfer")
if spec:
    print(f"NOTE: flashinfer is importable ({spec.origin}); for vLLM use --attention-backend FLASH_ATTN "
          "--no-enable-flashinfer-autotune and VLLM_USE_FLASHINFER_SAMPLER=0 (NOTES-deps.md)")
else:
    print("flashinfer not importable (good): VLLM_USE_FLASHINFER_SAMPLER=0 is REQUIRED, else the sampler "
          "fails to import vllm.v1.attention.backends.flashinfer")
print(f"import check took {time.time() - t0:.0f} s")
if bad:
    print("MISSING / BROKEN:\n  " + "\n  ".join(bad))
    sys.exit(1)
print("import check OK")
PY
