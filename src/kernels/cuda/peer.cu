// kernels/peer's protocol on the GPU (peer.cuh): every dtype and op, avg's division in the store.
#include <cuda_runtime.h>

#include "kernels/cuda/peer.cuh"
#include "kernels/cuda/types.cuh"

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

template <class T, int Op>
struct Combine {
  __device__ T operator()(T a, T b) const { return apply<T, Op>(a, b); }
};

// avg's division as the store's epilogue, as divide_kernel does it (reduce.cu).
template <class T>
struct DivideBy {
  int divisor;
  __device__ T operator()(T v, std::size_t) const {
    if (divisor <= 1) return v;
    if constexpr (is_half_like<T>) return from_float<T>(to_float(v) / static_cast<float>(divisor));
    else if constexpr (std::is_same_v<T, bool>) return v;
    else return static_cast<T>(v / static_cast<T>(divisor));
  }
};

template <class T, int Op>
__global__ void peer_all_reduce_kernel(peer::Devices devices, PeerPointers pointers, T* out, std::size_t count, int divisor,
                                       bool two_stage, std::uint32_t* failed) {
  const auto* const* inputs = reinterpret_cast<const T* const*>(pointers.inputs);
  const int block = static_cast<int>(blockIdx.x), blocks = static_cast<int>(gridDim.x);
  const int lane = static_cast<int>(threadIdx.x), lanes = static_cast<int>(blockDim.x);
  bool ok = false;
  if (two_stage) {
    ok = peer::two_stage<DeviceAtomics, T, T>(devices, block, blocks, lane, lanes, inputs, out, reinterpret_cast<T* const*>(pointers.scratch),
                                              count, Combine<T, Op>{}, DivideBy<T>{divisor});
  } else {
    ok = peer::one_stage<DeviceAtomics, T, T>(devices, block, blocks, lane, lanes, inputs, out, count, Combine<T, Op>{}, DivideBy<T>{divisor});
  }
  // A plain store: atomics on mapped host memory are not atomic for the host anyway, and any block's 1 says it.
  if (!ok && failed && lane == 0) *static_cast<volatile std::uint32_t*>(failed) = 1u;
}

template <class T, int Op>
int launch_typed(const peer::Devices& devices, const PeerPointers& pointers, void* out, std::size_t count, int divisor, bool two_stage,
                 int blocks, int lanes, std::uint32_t* failed, cudaStream_t stream) {
  constexpr bool bitwise = Op == bitwise_and || Op == bitwise_or || Op == bitwise_xor;
  if constexpr (bitwise && !std::is_integral_v<T>) {
    return static_cast<int>(cudaErrorInvalidValue);
  } else {
    peer_all_reduce_kernel<T, Op><<<blocks, lanes, 0, stream>>>(devices, pointers, static_cast<T*>(out), count, divisor, two_stage, failed);
    return static_cast<int>(cudaGetLastError());
  }
}

}  // namespace

int launch_peer_all_reduce(const peer::Devices& devices, const PeerPointers& pointers, void* out, std::size_t count, int dtype, int op,
                           int divisor, bool two_stage, int blocks, int lanes, std::uint32_t* failed, void* stream_handle) {
  if (blocks < 1 || blocks > peer::max_blocks || lanes < devices.n || lanes > 1024) return static_cast<int>(cudaErrorInvalidValue);
  auto stream = static_cast<cudaStream_t>(stream_handle);
  // bool is one byte holding 0 or 1, as in the reductions.
  return with_element_type<std::uint8_t>(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    switch (op) {
      case sum:
      case avg: return launch_typed<T, sum>(devices, pointers, out, count, divisor, two_stage, blocks, lanes, failed, stream);
      case prod: return launch_typed<T, prod>(devices, pointers, out, count, divisor, two_stage, blocks, lanes, failed, stream);
      case min_op: return launch_typed<T, min_op>(devices, pointers, out, count, divisor, two_stage, blocks, lanes, failed, stream);
      case max_op: return launch_typed<T, max_op>(devices, pointers, out, count, divisor, two_stage, blocks, lanes, failed, stream);
      case logical_and: return launch_typed<T, logical_and>(devices, pointers, out, count, divisor, two_stage, blocks, lanes, failed, stream);
      case logical_or: return launch_typed<T, logical_or>(devices, pointers, out, count, divisor, two_stage, blocks, lanes, failed, stream);
      case bitwise_and: return launch_typed<T, bitwise_and>(devices, pointers, out, count, divisor, two_stage, blocks, lanes, failed, stream);
      case bitwise_or: return launch_typed<T, bitwise_or>(devices, pointers, out, count, divisor, two_stage, blocks, lanes, failed, stream);
      case bitwise_xor: return launch_typed<T, bitwise_xor>(devices, pointers, out, count, divisor, two_stage, blocks, lanes, failed, stream);
    }
    return static_cast<int>(cudaErrorInvalidValue);
  });
}

}  // namespace weft::kernels::cuda
