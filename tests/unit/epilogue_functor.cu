// A user's own epilogue, compiled by nvcc through the public weft/gpu_epilogue.cuh only (test_epilogue_cuh
// uses it): x + (i % 7), stored as __half. Built only where CUDA is.
#include <cuda_fp16.h>

#include <weft/gpu_epilogue.cuh>

namespace {

struct PlusIndexToHalf {
  float step;
  __host__ __device__ __half operator()(float x, std::size_t i) const { return __float2half_rn(x + step * static_cast<float>(i % 7)); }
};

}  // namespace

weft::gpu::EpilogueFunctions plus_index_to_half(float step) {
  return weft::gpu::make_epilogue_functions<float, __half>(PlusIndexToHalf{step});
}
