// GPU reduction kernels (reduce.cuh). Grid-stride loops; the launch picks a grid that covers the SMs a
// few times over and lets each thread stride. Where the three buffers are 16-byte aligned (cudaMalloc's
// are; a view at an odd offset may not be) each thread moves 16 bytes per load and store, the widest
// the memory system serves in one instruction, and reduces the elements in them one by one (the same
// operation per element as the scalar loop, so the results are the same bits).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/types.cuh"

namespace weft::kernels::cuda {
namespace {

// Bytes [0, head) and [tail_at, tail_at + narrow - head) one by one, `wide` 16-byte words from head.
__global__ void copy_kernel(unsigned char* dst, const unsigned char* src, std::size_t head, std::size_t wide,
                            std::size_t tail_at, std::size_t narrow) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  auto* to = reinterpret_cast<uint4*>(dst + head);
  const auto* from = reinterpret_cast<const uint4*>(src + head);
  for (std::size_t i = first; i < wide; i += stride) to[i] = from[i];
  for (std::size_t i = first; i < narrow; i += stride) {
    const std::size_t at = i < head ? i : tail_at + (i - head);
    dst[at] = src[at];
  }
}

template <class T, int Op>
__global__ void reduce_kernel(T* dst, const T* a, const T* b, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = apply<T, Op>(a[i], b[i]);
  }
}

// 16 bytes of elements, loaded and stored as one.
template <class T>
struct alignas(16) Pack {
  static constexpr int size = static_cast<int>(16 / sizeof(T));
  T v[size];
};

template <class T, int Op>
__global__ void reduce_packed_kernel(T* dst, const T* a, const T* b, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t packs = n / Pack<T>::size;
  auto* out = reinterpret_cast<Pack<T>*>(dst);
  const auto* x = reinterpret_cast<const Pack<T>*>(a);
  const auto* y = reinterpret_cast<const Pack<T>*>(b);
  for (std::size_t i = first; i < packs; i += stride) {
    const Pack<T> p = x[i];
    const Pack<T> q = y[i];
    Pack<T> r;
#pragma unroll
    for (int k = 0; k < Pack<T>::size; ++k) r.v[k] = apply<T, Op>(p.v[k], q.v[k]);
    out[i] = r;
  }
  // The last n % size elements, one per thread.
  for (std::size_t i = packs * Pack<T>::size + first; i < n; i += stride) dst[i] = apply<T, Op>(a[i], b[i]);
}

template <class T>
__global__ void divide_kernel(T* data, std::size_t n, int divisor) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if constexpr (is_half_like<T>) {
      data[i] = from_float<T>(to_float(data[i]) / static_cast<float>(divisor));
    } else {
      data[i] = static_cast<T>(data[i] / static_cast<T>(divisor));
    }
  }
}

template <class T, int Op>
int launch_typed(void* dst, const void* a, const void* b, std::size_t n, cudaStream_t stream) {
  if constexpr ((Op == bitwise_and || Op == bitwise_or || Op == bitwise_xor) && !std::is_integral_v<T>) {
    return static_cast<int>(cudaErrorInvalidValue);
  } else {
    const auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
    if (aligned(dst) && aligned(a) && aligned(b)) {
      const std::size_t threads_needed = n / Pack<T>::size + n % Pack<T>::size;
      reduce_packed_kernel<T, Op><<<grid_for(threads_needed), threads_per_block, 0, stream>>>(
          static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n);
    } else {
      reduce_kernel<T, Op><<<grid_for(n), threads_per_block, 0, stream>>>(static_cast<T*>(dst), static_cast<const T*>(a),
                                                                           static_cast<const T*>(b), n);
    }
    return static_cast<int>(cudaGetLastError());
  }
}

template <class T>
int launch_for_type(void* dst, const void* a, const void* b, std::size_t n, int op, cudaStream_t stream) {
  switch (op) {
    case sum:
    case avg: return launch_typed<T, sum>(dst, a, b, n, stream);
    case prod: return launch_typed<T, prod>(dst, a, b, n, stream);
    case min_op: return launch_typed<T, min_op>(dst, a, b, n, stream);
    case max_op: return launch_typed<T, max_op>(dst, a, b, n, stream);
    case logical_and: return launch_typed<T, logical_and>(dst, a, b, n, stream);
    case logical_or: return launch_typed<T, logical_or>(dst, a, b, n, stream);
    case bitwise_and: return launch_typed<T, bitwise_and>(dst, a, b, n, stream);
    case bitwise_or: return launch_typed<T, bitwise_or>(dst, a, b, n, stream);
    case bitwise_xor: return launch_typed<T, bitwise_xor>(dst, a, b, n, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

template <class T>
int divide_typed(void* data, std::size_t n, int divisor, cudaStream_t stream) {
  divide_kernel<T><<<grid_for(n), threads_per_block, 0, stream>>>(static_cast<T*>(data), n, divisor);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int launch_reduce(void* dst, const void* a, const void* b, std::size_t n, int dtype, int op, void* stream_handle) {
  if (n == 0) return 0;
  auto stream = static_cast<cudaStream_t>(stream_handle);
  // bool is one byte holding 0 or 1, as on the CPU.
  return with_element_type<std::uint8_t>(dtype, [&](auto tag) {
    return launch_for_type<typename decltype(tag)::type>(dst, a, b, n, op, stream);
  });
}

int launch_copy(void* dst, const void* src, std::size_t bytes, void* stream_handle) {
  if (bytes == 0 || dst == src) return 0;
  auto* to = static_cast<unsigned char*>(dst);
  const auto* from = static_cast<const unsigned char*>(src);
  // 16 bytes per load and store where both addresses can reach 16-byte alignment together: the bytes
  // before that (head) and after the last whole 16 (tail) one by one.
  const auto d = reinterpret_cast<std::uintptr_t>(to);
  const auto s = reinterpret_cast<std::uintptr_t>(from);
  std::size_t head = bytes;
  std::size_t wide = 0;
  if ((d - s) % 16 == 0) {
    head = std::min<std::size_t>((16 - d % 16) % 16, bytes);
    wide = (bytes - head) / 16;
  }
  const std::size_t tail_at = head + wide * 16;
  const std::size_t narrow = head + (bytes - tail_at);
  copy_kernel<<<grid_for(wide > narrow ? wide : narrow), threads_per_block, 0, static_cast<cudaStream_t>(stream_handle)>>>(
      to, from, head, wide, tail_at, narrow);
  return static_cast<int>(cudaGetLastError());
}

int launch_divide(void* data, std::size_t n, int dtype, int divisor, void* stream_handle) {
  if (n == 0 || dtype == boolean) return 0;
  auto stream = static_cast<cudaStream_t>(stream_handle);
  return with_element_type<std::uint8_t>(dtype, [&](auto tag) {
    return divide_typed<typename decltype(tag)::type>(data, n, divisor, stream);
  });
}

}  // namespace weft::kernels::cuda
