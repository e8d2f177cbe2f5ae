#pragma once
/// Collectives over n-dimensional views, along an axis: the sharding API's `all_gather(x, axis)`,
/// `reduce_scatter(x, axis)`, `all_to_all(x, split_axis, concat_axis, tiled)` (a distributed transpose)
/// and `ppermute(x, pairs)`, and MLX's gather along the first axis. They are built on Group's buffer
/// collectives (one collective each, so they take one sequence number and are called in the same order
/// on every rank like any other).
///
/// Semantics (JAX's, `tiled` as there):
///   all_gather(x, axis)              untiled: a new axis of size p at `axis` (-ndim-1 .. ndim);
///                                    tiled: rank blocks concatenated along `axis` (extent p x n, or the
///                                    sum of `extents` when ranks hold uneven shards)
///   reduce_scatter(x, axis, op)      untiled: x.shape[axis] == p, the axis is removed and rank i keeps
///                                    the reduction of slice i; tiled: the axis is cut in p blocks (equal,
///                                    or `extents`) and rank i keeps the reduction of block i
///   all_to_all(x, split, concat)     untiled: x.shape[split] == p; slice j goes to rank j and the slices
///                                    received are stacked along a new axis `concat` of the result (which
///                                    has x's shape without `split`, with p inserted at `concat`); tiled:
///                                    x is cut in p blocks along `split`, block j goes to rank j, and the
///                                    blocks received are concatenated along `concat` (extent x p)
/// Axes may be negative (counted from the end, as in Python). The *_shape functions give the output's
/// shape for allocating it.
///
/// Memory: a tensor whose blocks lie contiguous in its memory (contiguous, and every axis before the
/// split or gathered one of extent 1: axis 0 of a row-major array) moves without any copy; otherwise its
/// blocks are packed into one staging buffer before the collective (on the calling thread), or unpacked
/// from one after it (on the loop's thread): one copy, not a chain of them.
///
/// Errors (at the call, weft::Error invalid_argument naming the rank and the operation): an axis out of
/// range, shapes that do not fit the collective or each other, a dtype that differs, strides that make
/// the output overlap itself, a device tensor that would need packing (device tensors move only where
/// no copy is needed). Running: as the buffer collective underneath.
/// Cancellation: as the Future's collective. Lifetime: both views' memory must stay valid until the
/// Future completes; the shape and stride vectors are copied.
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "weft/buffer.hpp"
#include "weft/dtype.hpp"
#include "weft/future.hpp"
#include "weft/reduce_op.hpp"

namespace weft {

class Group;

/// A view of an n-d array of `dtype` at `data`: `shape` in elements, `strides` in elements per step of
/// each axis (empty: row-major contiguous). Zero-dimensional views hold one element.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  std::vector<std::size_t> shape;
  std::vector<std::ptrdiff_t> strides;  // empty: contiguous, row-major
  Device device{};

  std::size_t ndim() const noexcept { return shape.size(); }
  /// Elements in the view (the product of the shape; 1 for zero dimensions).
  std::size_t size() const noexcept;
  /// The strides, filled in for a row-major view when `strides` is empty.
  std::vector<std::ptrdiff_t> effective_strides() const;
  /// Whether the elements lie row-major without gaps (axes of extent 1 may have any stride).
  bool contiguous() const noexcept;
};

/// The read-only form; every TensorView converts to it.
struct ConstTensorView {
  const void* data = nullptr;
  DType dtype = DType::f32;
  std::vector<std::size_t> shape;
  std::vector<std::ptrdiff_t> strides;
  Device device{};

  ConstTensorView() = default;
  ConstTensorView(const void* data_, DType dtype_, std::vector<std::size_t> shape_, std::vector<std::ptrdiff_t> strides_ = {},
                  Device device_ = {})
      : data(data_), dtype(dtype_), shape(std::move(shape_)), strides(std::move(strides_)), device(device_) {}
  ConstTensorView(const TensorView& v) : data(v.data), dtype(v.dtype), shape(v.shape), strides(v.strides), device(v.device) {}

  std::size_t ndim() const noexcept { return shape.size(); }
  std::size_t size() const noexcept;
  std::vector<std::ptrdiff_t> effective_strides() const;
  bool contiguous() const noexcept;
};

/// The output shapes, for allocating outputs. Errors: weft::Error (invalid_argument) as the collective's.
std::vector<std::size_t> all_gather_shape(std::span<const std::size_t> shape, int axis, int ranks, bool tiled = false);
std::vector<std::size_t> reduce_scatter_shape(std::span<const std::size_t> shape, int axis, int ranks, bool tiled = false);
std::vector<std::size_t> all_to_all_shape(std::span<const std::size_t> shape, int split_axis, int concat_axis, int ranks,
                                          bool tiled = false);

/// Every rank's `in` along `axis` into every rank's `out` (see the table above). `extents` (tiled only,
/// one per rank; empty: every rank's in.shape[axis]) gives uneven shards: rank i contributes extents[i]
/// along the axis (all_gatherv underneath), and every rank passes the same extents.
Future<void> all_gather(Group& group, ConstTensorView in, TensorView out, int axis, bool tiled = false,
                        std::vector<std::size_t> extents = {});
/// The reduction of every rank's `in`, cut along `axis`: this rank's part into `out`. `extents` (tiled
/// only; empty: equal blocks) cuts the axis unevenly (reduce_scatterv underneath).
Future<void> reduce_scatter(Group& group, ConstTensorView in, TensorView out, int axis, ReduceOp op = ReduceOp::sum,
                            bool tiled = false, std::vector<std::size_t> extents = {});
/// The distributed transpose: `in` cut along `split_axis`, part j to rank j, the parts received joined
/// along `concat_axis` of `out` in rank order.
Future<void> all_to_all(Group& group, ConstTensorView in, TensorView out, int split_axis, int concat_axis, bool tiled = false);
/// ppermute: for each (src, dst), src's `in` lands in dst's `out` (same shape); a rank that receives from
/// nobody gets zeros. As Group::permute.
Future<void> permute(Group& group, ConstTensorView in, TensorView out, std::vector<std::pair<int, int>> pairs);
/// The reduction of every rank's `in` into `out` (same shape, any strides).
Future<void> all_reduce(Group& group, ConstTensorView in, TensorView out, ReduceOp op = ReduceOp::sum);
/// root's `x` into every rank's `x`.
Future<void> broadcast(Group& group, TensorView x, int root);

}  // namespace weft
