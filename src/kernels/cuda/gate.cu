#include <cuda_runtime.h>

#include "kernels/cuda/gate.cuh"

namespace weft::kernels::cuda {
namespace {

__global__ void gate_wait(const volatile std::uint32_t* word) {
  // Volatile reads go to memory every time; the host's write reaches it over the bus. A short sleep
  // between reads keeps the spin off the memory system.
  while (*word == 0) __nanosleep(1000);
}

}  // namespace

int launch_gate_wait(const volatile std::uint32_t* word, void* stream_handle) {
  gate_wait<<<1, 1, 0, static_cast<cudaStream_t>(stream_handle)>>>(word);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace weft::kernels::cuda
