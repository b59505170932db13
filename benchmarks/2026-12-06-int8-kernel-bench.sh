#!/usr/bin/env bash
# Builds and runs the int8 kernel micro-benchmark: the working tree's csrc/int8_linear_cpu.cpp against the
# same file at a baseline commit (default 5a195d2, before the 2026-12-06 changes), both with the JIT
# build's flags.  usage: benchmarks/2026-12-06-int8-kernel-bench.sh [baseline commit | worktree] [repeats]
# (XFLAGS_OLD / XFLAGS_NEW: extra compiler flags for one side, e.g. to compare two settings of the working tree)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
base=${1:-5a195d2}
repeats=${2:-5}
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
mkdir -p "$build/old"
arena_old=
if [ "$base" = worktree ] || git -C "$root" show "$base:csrc/int8_linear.h" | grep -q int8_bytes; then arena_old=-DKERNEL_ARENA; fi
for f in int8_linear_cpu.cpp int8_linear.h block_linear.h; do
  if [ "$base" = worktree ]; then cp "$root/csrc/$f" "$build/old/$f"; else git -C "$root" show "$base:csrc/$f" > "$build/old/$f"; fi
done
flags="${XFLAGS:-} -O3 -fopenmp -march=native -mprefer-vector-width=512 -std=c++17"
bench="$root/benchmarks"
g++ $flags ${XFLAGS_OLD:-} -I"$build/old" -I"$bench" -Dtreespec=treespec_old -DKERNEL_API=kernel_old $arena_old -c "$bench/2026-12-06-int8-kernel-wrap.cpp" -o "$build/old.o" &
g++ $flags ${XFLAGS_NEW:-} -I"$root/csrc" -I"$bench" -DKERNEL_API=kernel_new -DKERNEL_ARENA -c "$bench/2026-12-06-int8-kernel-wrap.cpp" -o "$build/new.o" &
g++ $flags -I"$bench" -c "$bench/2026-12-06-int8-kernel-bench.cpp" -o "$build/main.o" &
wait
g++ $flags "$build/main.o" "$build/old.o" "$build/new.o" -o "$build/bench"
"$build/bench" "$repeats"
