#!/usr/bin/env bash
# A/B of the int8 native step: scripts/step_profile.py (or cost_curve.py) of a baseline commit (unpacked to
# a temporary folder, imported ahead of the working tree through PYTHONPATH; its extension is JIT-built from
# its own csrc) and of the working tree, alternated `rounds` times; each run's JSON lands in $out.
#   usage: benchmarks/2026-12-06-int8-step-ab.sh OUT_DIR [baseline commit] [rounds] [profile|cost|times|cpu]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$1
base=${2:-5a195d2}
rounds=${3:-3}
what=${4:-profile}
mkdir -p "$out"
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
git -C "$root" archive "$base" | tar -x -C "$tree"
py="$root/.venv/bin/python"
run() {  # side folder tag round
  if [ "$what" = times ]; then
    PYTHONPATH="$1" "$py" "$root/benchmarks/2026-12-06-int8-step-times.py" --nodes 1,16 --steps 150 --prefix 128 \
      --out "$out/$2-$3.json" 2>/dev/null
  elif [ "$what" = cpu ]; then  # one thread, process CPU time: the work, whatever the load
    for prefix in 128 512; do
      PYTHONPATH="$1" "$py" "$root/benchmarks/2026-12-06-int8-step-times.py" --nodes 1,2,4,8,16 --steps 60 \
        --prefix $prefix --threads 1 --cpu-time --out "$out/$2-$3-prefix$prefix.json" 2>/dev/null
    done
  elif [ "$what" = profile ]; then
    PYTHONPATH="$1" "$py" "$1/scripts/step_profile.py" --dtype float32 --numerics int8 --nodes 1,2,4,8,16 --steps 40 \
      --out "$out/$2-$3.json" 2>/dev/null | tail -6
  else
    PYTHONPATH="$1" "$py" "$1/scripts/cost_curve.py" --dtype float32 --paths int8 --prefixes 128,512 \
      --nodes 1,2,4,8,16 --budgets '' --repeats 5 --out "$out/$2-$3.json" 2>/dev/null | tail -14
  fi
}
for i in $(seq 1 "$rounds"); do
  echo "== round $i: baseline $base"; run "$tree" base "$i"
  echo "== round $i: working tree"; run "$root" new "$i"
done
