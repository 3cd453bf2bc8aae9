#!/usr/bin/env bash
# A revision's runtime (radixlm, srt, kernels, lang and the decode and serving benchmarks, ~1 MB) exported into a
# git-ignored folder, so that one device call can time it beside the working tree on the same machine:
#   tools/export_rev.sh REV [DIR]          (DIR default .before; carry it in the call)
#   ... then there: PYTHONPATH=$PWD/.before python .before/benchmarks/bench_decode.py ...
set -euo pipefail
rev=$1; dir=${2:-.before}
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude
rm -rf "$dir" && mkdir -p "$dir"
git archive "$rev" radixlm srt kernels lang benchmarks/bench_decode.py benchmarks/bench_serving.py \
  benchmarks/bench_offline.py benchmarks/workloads.py | tar -x -C "$dir"
echo "$rev" > "$dir/REV"
du -sh "$dir"
