// The argmax that greedy acceptance reads, as torch's x.max(dim=-1).indices defines it: a row's first NaN
// if it has one, else its first maximum. Computed over column ranges and merged in column order, so the
// lm_head's tasks can each take the maximum of the columns they just wrote (still in their core's cache)
// and the caller merges a few values per row. Kernel in argmax_cpu.cpp.
#pragma once

#include <cmath>
#include <cstdint>

namespace treespec {

struct RowMax {
  float value = -INFINITY;  // the largest value (a NaN found: unused)
  int64_t index = -1;       // its first column, or the first NaN's; -1: no column yet
  bool nan = false;
};

// The RowMax of columns [n0, n1) of one row (x points at the row's column 0).
RowMax row_max(const float* x, int64_t n0, int64_t n1);

// index[r] = the argmax of row r of x [rows, V] (row_max over every column), for r < rows; rows in parallel.
void rows_argmax(const float* x, int64_t rows, int64_t V, int64_t* index);

// into covers columns before later's: the RowMax of both ranges (earlier columns win ties).
inline void merge_row_max(RowMax& into, const RowMax& later) {
  if (later.index < 0 || into.nan) return;
  if (into.index < 0 || later.nan || later.value > into.value) into = later;
}

}  // namespace treespec
