#!/usr/bin/env bash
# The c32 ITL tail shows on some lent machines only. Probe first (PROBE_MODE, default the stall sampler with no
# step trace; C32_RUNS runs); go on with the A/B modes (HUNT_MODES, run_fastpath's TAILAB_MODES syntax;
# HUNT_TRACE) only when a probe run's p99/p50 is over HUNT_RATIO (default 2), so a quiet machine costs one server
# start and two runs.
# Usage (device tool): bash benchmarks/gpu/tail_hunt.sh DEST
set -u
source .gpu-bundle/activate
DEST=$1
SHOW="==|random-c32|guard|moved|pinned|done|stalls:|^  [a-z_]+ [0-9]|hiccup"  # the lines worth reading
export FI_BUILD=0 TAILAB_ROUNDS=1 C32_RUNS=${C32_RUNS:-2}
PROBE_MODE=${PROBE_MODE:-probe:STALLS=1,TRACE=0}
PROBE_DIR=/tmp/r/serving/tailab_${PROBE_MODE%%:*}1
rm -rf "$PROBE_DIR"  # a warm machine keeps /tmp/r: judge by this probe's runs only
TAILAB_MODES="$PROBE_MODE" BUDGET=${PROBE_BUDGET:-200} \
  bash benchmarks/gpu/run_fastpath.sh "$DEST" tailab 2>&1 | grep -E "$SHOW"
if python - "$PROBE_DIR" "${HUNT_RATIO:-2}" <<'PY'
import glob, json, sys
ratios = [d["itl_ms"]["p99"] / d["itl_ms"]["p50"] for f in glob.glob(f"{sys.argv[1]}/random_c32*.json")
          for d in [json.load(open(f))]]
print("probe: worst p99/p50", max(ratios, default=0.0))
sys.exit(0 if max(ratios, default=0.0) > float(sys.argv[2]) else 1)
PY
then
  echo "tail machine: A/B modes follow"
  TAILAB_MODES="$HUNT_MODES" TAILAB_TRACE=${HUNT_TRACE:-1} BUDGET=${HUNT_BUDGET:-380} \
    bash benchmarks/gpu/run_fastpath.sh "$DEST" tailab 2>&1 | grep -E "$SHOW"
else
  echo "quiet machine: no A/B"
fi
