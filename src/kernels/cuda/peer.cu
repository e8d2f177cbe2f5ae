#include <cuda_runtime.h>

#include "kernels/cuda/peer.cuh"

namespace weft::kernels::cuda {
namespace {

// System scope: the flags live in memory of other devices (P2P) and the data they order too.
struct DeviceAtomics {
  __device__ static void store_release(std::uint32_t* p, std::uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  }
  __device__ static std::uint32_t load_acquire(const std::uint32_t* p) {
    std::uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
  }
  __device__ static bool pause(std::uint64_t spins) {
#ifdef WEFT_PEER_SPIN_BOUND
    return spins < WEFT_PEER_SPIN_BOUND;  // debug builds: a lost peer fails the call instead of hanging
#else
    (void)spins;
    return true;
#endif
  }
  __device__ static void sync_block() { __syncthreads(); }
  __device__ static bool sync_block_all(bool ok) { return __syncthreads_and(ok) != 0; }
};

struct Sum {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct Identity {
  __device__ float operator()(float v, std::size_t) const { return v; }
};

__global__ void peer_all_reduce_f32_sum(peer::Devices devices, PeerPointers pointers, float* out, std::size_t count,
                                        bool two_stage, std::uint32_t* failed) {
  const auto* const* inputs = reinterpret_cast<const float* const*>(pointers.inputs);
  bool ok = false;
  if (two_stage) {
    ok = peer::two_stage<DeviceAtomics, float, float>(devices, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x),
                                                      static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x), inputs, out,
                                                      reinterpret_cast<float* const*>(pointers.scratch), count, Sum{}, Identity{});
  } else {
    ok = peer::one_stage<DeviceAtomics, float, float>(devices, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x),
                                                      static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x), inputs, out,
                                                      count, Sum{}, Identity{});
  }
  if (!ok && failed && threadIdx.x == 0) atomicExch(failed, 1u);
}

}  // namespace

int launch_peer_all_reduce_f32_sum(const peer::Devices& devices, const PeerPointers& pointers, void* out, std::size_t count,
                                   bool two_stage, int blocks, int lanes, std::uint32_t* failed, void* stream) {
  if (blocks < 1 || blocks > peer::max_blocks || lanes < devices.n) return static_cast<int>(cudaErrorInvalidValue);
  peer_all_reduce_f32_sum<<<blocks, lanes, 0, static_cast<cudaStream_t>(stream)>>>(devices, pointers, static_cast<float*>(out), count,
                                                                                   two_stage, failed);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace weft::kernels::cuda
