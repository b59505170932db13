// One linear's descriptor from the four tensor slots Python passes for it (core/native.py `linear_slots`):
// the weight (or the blocks' q), d, m and bias, checked against [N, K]. The native step's and the native
// heads' bindings read their linears through it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "block_linear.h"

namespace treespec {

LinearWeights linear_from_slots(const std::vector<at::Tensor>& tensors, size_t at, int64_t kind, int64_t N, int64_t K);

}  // namespace treespec
