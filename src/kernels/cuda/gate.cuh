#pragma once
// The device side of weft::gpu::Gate under CUDA: a one-thread kernel that holds its stream until the host
// writes a nonzero word into mapped (page-locked, device-visible) memory. It keeps the host function
// thread of the CUDA runtime out of the path (a host function that blocked would stall every other host
// function of the process) and costs one resident block while it waits.
#include <cstdint>

namespace weft::kernels::cuda {

/// Queues, on `stream` (a cudaStream_t), a kernel that returns once `*word` (mapped host memory, as
/// cudaHostAlloc(cudaHostAllocMapped) gives) is nonzero. Returns the launch's cudaError_t (0: queued).
int launch_gate_wait(const volatile std::uint32_t* word, void* stream);

}  // namespace weft::kernels::cuda
