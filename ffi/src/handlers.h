// handlers.h -- every XLA FFI handler the extension exports (defined in <op>.cc, one per op and platform), and the
// host helpers module.cc hands to Python beside them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

// By op: quant.cc, quant_mx.cc, a2a.cc, grouped_gemm.cc, rows.cc.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8BlockwiseCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8WeightCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8WeightWithTransposeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8GroupedKmajorCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aQuantizeMxfp8Cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aDequantizeMxfp8Cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aNvfp4GlobalScaleCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aQuantizeNvfp4Cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aDequantizeNvfp4Cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aDispatchCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aCombineCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aGroupedGemmFp8Cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aGroupedGemmFp8WgradCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aGroupedGemmBf16Cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aGatherRowsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aScatterRowsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aSumRowsCpu);
#ifdef JAX_MOE_A2A_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8BlockwiseCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8WeightCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8WeightWithTransposeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8GroupedKmajorCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aQuantizeMxfp8Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aDequantizeMxfp8Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aNvfp4GlobalScaleCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aQuantizeNvfp4Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aDequantizeNvfp4Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aDispatchCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aCombineCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aGroupedGemmFp8Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aGroupedGemmFp8WgradCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aGroupedGemmBf16Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aGatherRowsCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aScatterRowsCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aSumRowsCuda);
#endif


namespace jax_moe_a2a {

// Bytes of device scratch the grouped GEMM call of `num_groups` groups needs (grouped_gemm.cc).
size_t GroupedGemmScratchBytes(int64_t num_groups, int32_t bf16_mode, bool f32_out);

// Bytes of device scratch the grouped_gemm_fp8_wgrad call of `num_groups` groups needs (grouped_gemm.cc).
size_t GroupedGemmFp8WgradScratchBytes(int64_t num_groups);

}  // namespace jax_moe_a2a
