// rows_kernels.cuh -- launchers of the row-movement kernels of the expert stage (implemented in rows_kernels.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_moe_a2a {

enum class RowType { kBF16, kF32 };

// out[i, :] = x[idx[i], :] for idx[i] in [0, num_x_rows), else 0 (rows of row_bytes bytes, any number).
cudaError_t LaunchGatherRows(cudaStream_t stream, const void* x, const int32_t* idx, void* out, int64_t num_x_rows,
                             int64_t num_out_rows, int64_t row_bytes);

// out[pos[r, j], :] = x[r, :] for r < num_x_rows, j < k, skipping positions outside [0, num_out_rows) (rows of
// row_bytes bytes). Output rows no position names are not written.
cudaError_t LaunchScatterRows(cudaStream_t stream, const void* x, const int32_t* pos, void* out, int64_t num_x_rows,
                              int64_t k, int64_t num_out_rows, int64_t row_bytes);

// out[i, :] = to_out(float(x[idx[i], :]) * scale[i]) (0 where idx[i] is out of range); hidden % 8 == 0, x and out
// bfloat16 or float32.
cudaError_t LaunchGatherRowsScaled(cudaStream_t stream, RowType in, RowType out_type, const void* x,
                                   const int32_t* idx, const float* scale, void* out, int64_t num_x_rows,
                                   int64_t num_out_rows, int64_t hidden);

// out[r, :] = to_out(sum over j < k in ascending order of float(y[pos[r, j], :]) * weights[r, j]), the terms of
// pos[r, j] outside [0, num_y_rows) left out; weights may be null (all 1). hidden % 8 == 0, k <= 32, y and out
// bfloat16 or float32.
cudaError_t LaunchSumRows(cudaStream_t stream, RowType in, RowType out_type, const void* y, const int32_t* pos,
                          const float* weights, void* out, int64_t num_y_rows, int64_t num_out_rows, int64_t k,
                          int64_t hidden);

}  // namespace jax_moe_a2a
