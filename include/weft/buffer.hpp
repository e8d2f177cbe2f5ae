#pragma once
/// Buffer views: what every send, recv and collective reads from or writes to. A view does not own its
/// memory; the memory must stay valid until the operation's Future completes.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "weft/dtype.hpp"

namespace weft {

/// The most bytes one buffer may span: 128 TiB, the user address space of x86-64 and aarch64 (48-bit).
/// A count or view beyond it is a bug (or an attack) whose byte count would wrap or drive allocations;
/// every call refuses it (weft::Error, invalid_argument: "more than memory can hold").
inline constexpr std::size_t max_buffer_bytes = std::size_t{1} << 47;

/// Where a buffer lives. Only host memory is moved today; the device field is carried so that the GPU
/// transports can accept device pointers without a new vocabulary.
struct Device {
  enum class Kind : std::uint8_t { host, cuda };
  Kind kind = Kind::host;
  int index = 0;
  friend bool operator==(const Device&, const Device&) = default;
};

/// A writable view of `count` elements of type `dtype`.
struct BufferView {
  void* data = nullptr;
  std::size_t count = 0;
  DType dtype = DType::u8;
  Device device{};

  BufferView() = default;
  BufferView(void* data_, std::size_t count_, DType dtype_, Device device_ = {})
      : data(data_), count(count_), dtype(dtype_), device(device_) {}
  template <class T>
  BufferView(std::span<T> s) : data(s.data()), count(s.size()), dtype(dtype_of<T>) {}
  template <class T>
  BufferView(std::vector<T>& v) : data(v.data()), count(v.size()), dtype(dtype_of<T>) {}

  /// count x the element's size; SIZE_MAX where the product does not fit (a count no memory holds, which
  /// every call refuses) rather than a small wrapped number that a bounds check would pass.
  std::size_t bytes() const noexcept {
    std::size_t product = 0;
    return __builtin_mul_overflow(count, dtype_size(dtype), &product) ? SIZE_MAX : product;
  }
  std::byte* bytes_ptr() const noexcept { return static_cast<std::byte*>(data); }
};

/// A read-only view; every BufferView converts to it.
struct ConstBufferView {
  const void* data = nullptr;
  std::size_t count = 0;
  DType dtype = DType::u8;
  Device device{};

  ConstBufferView() = default;
  ConstBufferView(const void* data_, std::size_t count_, DType dtype_, Device device_ = {})
      : data(data_), count(count_), dtype(dtype_), device(device_) {}
  ConstBufferView(const BufferView& v) : data(v.data), count(v.count), dtype(v.dtype), device(v.device) {}
  template <class T>
  ConstBufferView(std::span<T> s) : data(s.data()), count(s.size()), dtype(dtype_of<T>) {}
  template <class T>
  ConstBufferView(const std::vector<T>& v) : data(v.data()), count(v.size()), dtype(dtype_of<T>) {}

  /// As BufferView::bytes: SIZE_MAX where count x the element's size does not fit.
  std::size_t bytes() const noexcept {
    std::size_t product = 0;
    return __builtin_mul_overflow(count, dtype_size(dtype), &product) ? SIZE_MAX : product;
  }
  const std::byte* bytes_ptr() const noexcept { return static_cast<const std::byte*>(data); }
};

/// weft::view(x): a view of a std::vector or std::span, or of pointer + count (+ dtype).
template <class T>
BufferView view(std::vector<T>& v) { return BufferView(v); }
template <class T>
ConstBufferView view(const std::vector<T>& v) { return ConstBufferView(v); }
template <class T>
BufferView view(std::span<T> s) { return BufferView(s); }
template <class T>
ConstBufferView view(std::span<const T> s) { return ConstBufferView(s); }
template <class T>
BufferView view(T* p, std::size_t count) { return BufferView(p, count, dtype_of<T>); }
template <class T>
ConstBufferView view(const T* p, std::size_t count) { return ConstBufferView(p, count, dtype_of<T>); }

}  // namespace weft
