#!/usr/bin/env bash
# Build .peer-wheels/: the wheels listed in benchmarks/peers/requirements-vllm.txt, for the offline GPU machine
# (CPython 3.12, manylinux x86_64, binary only, --no-deps: exactly the pinned list, nothing resolved).
# Every file written is at most 60 MiB: small wheels are copied as they are, big ones are split into
# NAME.whl.part-aa, NAME.whl.part-ab, ...; SHA256SUMS holds the digests of the whole wheels.
# Run from anywhere in the repo, on a machine with registry access. Idempotent: the output folder is rebuilt
# from scratch (atomically) on every run.
#
#   benchmarks/peers/build_wheelhouse.sh
#
# Environment (all optional):
#   PEER_WHEELS_DIR   output folder (default: <repo>/.peer-wheels; inside the repo it must be git-ignored,
#                     else it would travel with every device run and break the 64 MiB working-tree limit)
#   PEER_WHEEL_CACHE  folder for the downloads, kept between runs (default: a temp folder, removed at exit)
#   PEER_SPLIT_SIZE   part size for `split -b` (default 48M: a part and the tracked tree, ~8 MB and growing, fit
#                     one device call's 64 MiB; 56M parts stopped fitting on 2026-11-27)
#   PYTHON            interpreter whose pip downloads (default python3)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || (cd "$here/../.." && pwd))
req="$here/requirements-vllm.txt"
out=${PEER_WHEELS_DIR:-$root/.peer-wheels}
out=$(mkdir -p "$(dirname "$out")" && cd "$(dirname "$out")" && pwd)/$(basename "$out")
split_size=${PEER_SPLIT_SIZE:-48M}
split_bytes=$(numfmt --from=iec "$split_size")
py=${PYTHON:-python3}

case "$out/" in
  "$root"/*)
    if ! git -C "$root" check-ignore -q "${out#"$root"/}/"; then
      echo "error: $out is inside the repo but not git-ignored." >&2
      echo "       Add '/$(basename "$out")/' to .gitignore (or .git/info/exclude) first, or set PEER_WHEELS_DIR." >&2
      exit 1
    fi ;;
esac

tmpdirs=()
cleanup() { rm -rf "${tmpdirs[@]}"; }
trap cleanup EXIT
if [ -n "${PEER_WHEEL_CACHE:-}" ]; then
  dl=$PEER_WHEEL_CACHE; mkdir -p "$dl"
else
  dl=$(mktemp -d /tmp/peer-wheel-dl.XXXXXX); tmpdirs+=("$dl")
fi

# manylinux tags up to glibc 2.39 (the GPU machine runs Ubuntu's glibc 2.39); pip matches tags exactly.
plat=()
for n in $(seq 39 -1 17) 12 5; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64 --platform any)

echo "downloading $(grep -cE '^[A-Za-z0-9]' "$req") pinned wheels into $dl ..."
PIP_DISABLE_PIP_VERSION_CHECK=1 "$py" -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${plat[@]}" -d "$dl" -r "$req" 2>&1 | grep -v '^WARNING' || true

# Pick exactly one wheel per requirement line (the cache may hold other versions from earlier runs).
mapfile -t wheels < <("$py" - "$req" "$dl" <<'PY'
import os, re, sys
req, dl = sys.argv[1:]
files = os.listdir(dl)
bad = False
for line in open(req):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    m = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!_-]+)", line)
    if not m:
        sys.exit(f"requirements line is not NAME==VERSION: {line!r}")
    name = re.sub(r"[-_.]+", "_", m[1]).lower()
    hits = [f for f in files if f.endswith(".whl") and f.lower().startswith(f"{name}-{m[2].lower()}-")]
    if len(hits) != 1:
        print(f"error: {len(hits)} wheels for {line}: {hits}", file=sys.stderr); bad = True
    else:
        print(os.path.join(dl, hits[0]))
sys.exit(1 if bad else 0)
PY
)
[ "${#wheels[@]}" -gt 0 ] || { echo "error: no wheels selected" >&2; exit 1; }

stage=$(mktemp -d "$(dirname "$out")/.$(basename "$out").new.XXXXXX"); tmpdirs+=("$stage")
: > "$stage/SHA256SUMS"
for w in "${wheels[@]}"; do
  b=$(basename "$w")
  (cd "$(dirname "$w")" && sha256sum "$b") >> "$stage/SHA256SUMS"
  if [ "$(stat -c %s "$w")" -gt "$split_bytes" ]; then
    split -b "$split_size" "$w" "$stage/$b.part-"
  else
    cp "$w" "$stage/$b"
  fi
done
rm -rf "$out"
mv "$stage" "$out"
chmod 755 "$out"

echo
echo "$out:"
( cd "$out" && ls -l --time-style=+ | awk 'NR>1 {printf "  %9.2f MB  %s\n", $5/1e6, $NF}' )
big=$(find "$out" -type f -size +"${split_bytes}"c | wc -l)
[ "$big" -eq 0 ] || { echo "error: $big files above $split_size" >&2; exit 1; }
wheel_bytes=$(for w in "${wheels[@]}"; do stat -c %s "$w"; done | awk '{s+=$1} END {print s}')
echo "wheels: ${#wheels[@]} ($(awk -v b="$wheel_bytes" 'BEGIN {printf "%.1f MB", b/1e6}') in all)," \
     "files: $(find "$out" -type f | wc -l), parts: $(find "$out" -name '*.part-*' | wc -l)," \
     "total on disk: $(du -sb "$out" | awk '{printf "%.1f MB", $1/1e6}')," \
     "largest file: $(find "$out" -type f -printf '%s\n' | sort -n | tail -1 | awk '{printf "%.1f MB", $1/1e6}')"
