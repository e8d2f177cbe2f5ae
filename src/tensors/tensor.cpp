// Collectives over n-d views (weft/tensor.hpp), built from the public Group API only, as a user's
// library would be: each cuts its tensors into per-rank blocks along an axis, hands the blocks to one
// buffer collective (straight from the user's memory where they lie contiguous in it, else through one
// staging buffer), and unpacks what the collective wrote where it could not write in place.
#include "weft/tensor.hpp"

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "weft/error.hpp"
#include "weft/group.hpp"
#include "weft/task.hpp"

namespace weft {
namespace {

using Shape = std::vector<std::size_t>;
using Strides = std::vector<std::ptrdiff_t>;

std::size_t product(std::span<const std::size_t> shape) {
  return std::accumulate(shape.begin(), shape.end(), std::size_t{1}, std::multiplies<>());
}

Strides row_major(std::span<const std::size_t> shape) {
  Strides strides(shape.size());
  std::ptrdiff_t step = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    strides[i] = step;
    step *= static_cast<std::ptrdiff_t>(shape[i]);
  }
  return strides;
}

bool is_contiguous(std::span<const std::size_t> shape, std::span<const std::ptrdiff_t> strides) {
  if (strides.empty() || product(shape) == 0) return true;
  std::ptrdiff_t expected = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= static_cast<std::ptrdiff_t>(shape[i]);
  }
  return true;
}

[[noreturn]] void bad(const Group& g, const char* op, const std::string& detail) {
  throw Error(Errc::invalid_argument, ErrorContext{.rank = g.rank(), .op = op}, detail);
}

// `axis` of a tensor of `ndim` dimensions, negative counted from the end.
std::size_t normalize(const Group& g, const char* op, const char* what, int axis, std::size_t ndim) {
  const auto n = static_cast<long>(ndim);
  const long a = axis < 0 ? axis + n : axis;
  if (a < 0 || a >= n) bad(g, op, fmt::format("{} {} is out of range for {} dimensions", what, axis, ndim));
  return static_cast<std::size_t>(a);
}

template <class V>
void check_view(const Group& g, const char* op, const char* name, const V& v) {
  if (!v.strides.empty() && v.strides.size() != v.shape.size()) {
    bad(g, op, fmt::format("{} has {} strides for {} dimensions", name, v.strides.size(), v.shape.size()));
  }
  if (!is_valid(v.dtype)) bad(g, op, fmt::format("{}'s dtype {} is not a weft DType", name, static_cast<unsigned>(v.dtype)));
  // The elements, and the furthest one the strides reach, without wrapping: a shape of 2^40 x 2^40 was a
  // view of 0 elements (2^80 wrapped), and a stride of 2^62 wrapped around the address space back onto
  // the first row. Both are more than any memory holds (2^47 bytes, as for the buffer collectives).
  const std::size_t limit = max_buffer_bytes / dtype_size(v.dtype);
  std::size_t elements = 1;
  std::size_t reach = 0;  // in elements from the first, along every axis at its far end
  bool too_large = false;
  for (std::size_t i = 0; i < v.shape.size(); ++i) {
    if (v.shape[i] == 0) return;  // an empty view touches no memory, whatever its other extents
    too_large = too_large || __builtin_mul_overflow(elements, v.shape[i], &elements) || elements > limit;
    const std::size_t stride = v.strides.empty() ? 0 : (v.strides[i] < 0 ? static_cast<std::size_t>(-(v.strides[i] + 1)) + 1 : static_cast<std::size_t>(v.strides[i]));
    std::size_t step = 0;
    too_large = too_large || __builtin_mul_overflow(stride, v.shape[i] - 1, &step) || __builtin_add_overflow(reach, step, &reach) ||
                reach >= limit;
  }
  if (too_large) {
    bad(g, op, fmt::format("{} of shape {} and strides {} spans more than memory can hold (at most 2^47 bytes)", name, v.shape,
                           v.strides));
  }
  if (v.data == nullptr && elements > 0) bad(g, op, fmt::format("{} is null with shape {}", name, v.shape));
}

// Whether two elements of a view share memory: sorted by stride, each axis must step past everything
// the axes below it reach (the usual sufficient test; views of real arrays pass it).
bool overlaps_itself(std::span<const std::size_t> shape, std::span<const std::ptrdiff_t> strides) {
  if (strides.empty() || product(shape) <= 1) return false;
  std::vector<std::pair<std::size_t, std::size_t>> axes;  // (|stride|, extent) of the axes that move
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] > 1) axes.emplace_back(static_cast<std::size_t>(std::abs(strides[i])), shape[i]);
  }
  std::sort(axes.begin(), axes.end());
  std::size_t reach = 0;  // the furthest element the smaller axes reach, in elements
  for (auto [stride, extent] : axes) {
    if (stride <= reach) return true;
    reach += stride * (extent - 1);
  }
  return false;
}

void check_output(const Group& g, const char* op, const TensorView& out, std::span<const std::size_t> expected) {
  check_view(g, op, "output", out);
  if (!std::equal(out.shape.begin(), out.shape.end(), expected.begin(), expected.end())) {
    bad(g, op, fmt::format("output has shape {}, expected {}", out.shape, expected));
  }
  if (overlaps_itself(out.shape, out.strides)) bad(g, op, fmt::format("output's strides {} make it overlap itself", out.strides));
}

void check_types(const Group& g, const char* op, DType in, DType out) {
  if (in != out) bad(g, op, fmt::format("input is {} but output is {}", to_string(in), to_string(out)));
}

// ---- strided copies between a view and a packed row-major buffer

// Copies the region `shape` between two layouts (strides in elements, pointers at element 0), merging
// axes that are contiguous in both into one so that rows move with one memcpy.
void copy_region(std::byte* dst, Strides dst_strides, const std::byte* src, Strides src_strides, Shape shape, std::size_t esize) {
  if (product(shape) == 0) return;
  // Drop axes of extent 1, then merge axis i into i+1 where both layouts step over it as one.
  Shape s;
  Strides d, r;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 1) continue;
    if (!s.empty() && d.back() == dst_strides[i] * static_cast<std::ptrdiff_t>(shape[i]) &&
        r.back() == src_strides[i] * static_cast<std::ptrdiff_t>(shape[i])) {
      s.back() *= shape[i];
      d.back() = dst_strides[i];
      r.back() = src_strides[i];
      continue;
    }
    s.push_back(shape[i]);
    d.push_back(dst_strides[i]);
    r.push_back(src_strides[i]);
  }
  const auto e = static_cast<std::ptrdiff_t>(esize);
  if (s.empty()) {
    std::memcpy(dst, src, esize);
    return;
  }
  const std::size_t last = s.size() - 1;
  const bool rows = d[last] == 1 && r[last] == 1;
  // An odometer over every axis but the last; the last moves as one memcpy when both sides are dense.
  std::vector<std::size_t> index(s.size(), 0);
  for (;;) {
    std::ptrdiff_t dst_at = 0, src_at = 0;
    for (std::size_t i = 0; i < last; ++i) {
      dst_at += static_cast<std::ptrdiff_t>(index[i]) * d[i];
      src_at += static_cast<std::ptrdiff_t>(index[i]) * r[i];
    }
    if (rows) {
      std::memcpy(dst + dst_at * e, src + src_at * e, s[last] * esize);
    } else {
      for (std::size_t k = 0; k < s[last]; ++k) {
        std::memcpy(dst + (dst_at + static_cast<std::ptrdiff_t>(k) * d[last]) * e, src + (src_at + static_cast<std::ptrdiff_t>(k) * r[last]) * e, esize);
      }
    }
    std::size_t i = last;
    while (i > 0) {
      --i;
      if (++index[i] < s[i]) break;
      index[i] = 0;
      if (i == 0) return;
    }
    if (last == 0) return;
  }
}

// A tensor seen as p blocks along `axis`: block i is [offsets[i], offsets[i] + extents[i]) of the axis.
struct Blocks {
  std::byte* data = nullptr;  // element 0 of the tensor
  Shape shape;
  Strides strides;
  std::size_t axis = 0;
  Shape extents;
  std::size_t esize = 1;
  bool dense = false;  // the tensor is contiguous

  std::size_t offset(std::size_t i) const { return std::accumulate(extents.begin(), extents.begin() + static_cast<std::ptrdiff_t>(i), std::size_t{0}); }
  // Elements of one unit of the axis (the product of the other extents).
  std::size_t across() const {
    std::size_t n = 1;
    for (std::size_t i = 0; i < shape.size(); ++i) n *= i == axis ? 1 : shape[i];
    return n;
  }
  std::size_t count(std::size_t i) const { return extents[i] * across(); }
  std::size_t total() const { return std::accumulate(extents.begin(), extents.end(), std::size_t{0}) * across(); }
  // The blocks lie one after the other in the tensor's memory, in order: no staging needed (one block
  // is the whole tensor).
  bool in_place() const {
    std::size_t outer = 1;
    for (std::size_t i = 0; i < axis; ++i) outer *= shape[i];
    return dense && (outer <= 1 || extents.size() == 1);
  }
  // Copies every block into `packed` (block after block, each row-major), or back.
  void pack(std::byte* packed) const { move(packed, true); }
  void unpack(const std::byte* packed) const { move(const_cast<std::byte*>(packed), false); }

 private:
  void move(std::byte* packed, bool out_of_tensor) const {
    std::size_t at = 0;
    for (std::size_t i = 0; i < extents.size(); ++i) {
      Shape block = shape;
      block[axis] = extents[i];
      std::byte* first = data + static_cast<std::ptrdiff_t>(offset(i)) * strides[axis] * static_cast<std::ptrdiff_t>(esize);
      if (out_of_tensor) copy_region(packed + at * esize, row_major(block), first, strides, block, esize);
      else copy_region(first, strides, packed + at * esize, row_major(block), block, esize);
      at += count(i);
    }
  }
};

template <class V>
Blocks blocks_of(const V& v, Shape shape, std::size_t axis, Shape extents) {
  Blocks b;
  b.data = static_cast<std::byte*>(const_cast<void*>(static_cast<const void*>(v.data)));
  b.strides = v.effective_strides();
  b.dense = v.contiguous();
  b.shape = std::move(shape);
  b.axis = axis;
  b.extents = std::move(extents);
  b.esize = dtype_size(v.dtype);
  return b;
}

// A unit axis inserted at `at` (an untiled collective's view of a tensor that lacks the rank axis).
template <class V>
void insert_unit_axis(V& v, std::size_t at) {
  auto strides = v.effective_strides();
  v.shape.insert(v.shape.begin() + static_cast<std::ptrdiff_t>(at), 1);
  strides.insert(strides.begin() + static_cast<std::ptrdiff_t>(at), 1);
  v.strides = std::move(strides);
}

// The staging of one tensor collective: the buffers it owns until it completes.
struct Staging {
  std::unique_ptr<std::byte[]> send, recv;
};

std::byte* room(std::unique_ptr<std::byte[]>& where, std::size_t bytes) {
  where = std::make_unique_for_overwrite<std::byte[]>(std::max<std::size_t>(1, bytes));
  return where.get();
}

void require_host(const Group& g, const char* op, Device device, bool staged) {
  if (staged && device.kind != Device::Kind::host) {
    bad(g, op, "a device tensor whose blocks do not lie contiguous in its memory would need packing on the host; "
               "make it contiguous (with the split axis first) or copy it to the host");
  }
}

Task<void> finish(Future<void> op, std::shared_ptr<Staging> staging, Blocks unpack_into, bool unpack) {
  co_await std::move(op);
  if (unpack) unpack_into.unpack(staging->recv.get());
}

// Runs `collective(send, recv)` over the blocks: straight from and into the tensors where they allow it,
// else through staging; unpacks `out` after it completes where it was staged.
template <class Run>
Future<void> run_blocks(Group& g, const char* op, const Blocks& in, Device in_device, const Blocks& out, Device out_device, DType dtype,
                        std::size_t send_count, std::size_t recv_count, Run&& collective) {
  auto staging = std::make_shared<Staging>();
  const bool stage_in = !in.in_place();
  const bool stage_out = !out.in_place();
  require_host(g, op, in_device, stage_in);
  require_host(g, op, out_device, stage_out);
  const std::size_t esize = dtype_size(dtype);
  const std::byte* send = in.data;
  if (stage_in) {
    std::byte* packed = room(staging->send, in.total() * esize);
    in.pack(packed);
    send = packed;
  }
  std::byte* recv = stage_out ? room(staging->recv, out.total() * esize) : out.data;
  Future<void> started = collective(ConstBufferView(send, send_count, dtype, stage_in ? Device{} : in_device),
                                    BufferView(recv, recv_count, dtype, stage_out ? Device{} : out_device));
  if (!stage_in && !stage_out) return started;
  return spawn(g.loop(), finish(std::move(started), std::move(staging), out, stage_out));
}

// A tensor as one block (the collectives whose output has the input's shape).
template <class V>
Blocks whole(const V& v) {
  return blocks_of(v, v.shape, 0, Shape{v.ndim() ? v.shape[0] : 1});
}

// permute and all_reduce: `out` has `in`'s shape, each moves as one block.
template <class Run>
Future<void> same_shape(Group& g, const char* op, const ConstTensorView& in, const TensorView& out, Run&& collective) {
  check_view(g, op, "input", in);
  check_types(g, op, in.dtype, out.dtype);
  check_output(g, op, out, in.shape);
  const Blocks send = whole(in);
  const Blocks recv = whole(out);
  return run_blocks(g, op, send, in.device, recv, out.device, in.dtype, send.total(), recv.total(), collective);
}

Shape deleted(Shape s, std::size_t at) {
  s.erase(s.begin() + static_cast<std::ptrdiff_t>(at));
  return s;
}
Shape inserted(Shape s, std::size_t at, std::size_t extent) {
  s.insert(s.begin() + static_cast<std::ptrdiff_t>(at), extent);
  return s;
}

// The tiled or untiled all_gather's axis, the shapes both sides are seen as, and the output's shape.
struct GatherPlan {
  std::size_t axis;
  Shape in_shape;  // with the unit axis where untiled
  Shape out_shape;
  Shape extents;
};

GatherPlan plan_gather(const Group& g, const char* op, std::span<const std::size_t> shape, int axis, bool tiled, Shape extents) {
  const auto p = static_cast<std::size_t>(g.size());
  GatherPlan plan;
  plan.in_shape.assign(shape.begin(), shape.end());
  if (tiled) {
    plan.axis = normalize(g, op, "axis", axis, shape.size());
  } else {
    if (!extents.empty()) bad(g, op, "extents are for the tiled form (an untiled gather stacks equal shapes)");
    plan.axis = normalize(g, op, "axis", axis, shape.size() + 1);
    plan.in_shape = inserted(plan.in_shape, plan.axis, 1);
  }
  const std::size_t mine = plan.in_shape[plan.axis];
  if (extents.empty()) {
    extents.assign(p, mine);
  } else {
    if (extents.size() != p) bad(g, op, fmt::format("extents has {} entries; it needs one per rank of this group of {}", extents.size(), p));
    const auto r = static_cast<std::size_t>(g.rank());
    if (extents[r] != mine) bad(g, op, fmt::format("extents[{}] = {} but this rank's input has {} along axis {}", r, extents[r], mine, plan.axis));
  }
  plan.out_shape = plan.in_shape;
  plan.out_shape[plan.axis] = std::accumulate(extents.begin(), extents.end(), std::size_t{0});
  plan.extents = std::move(extents);
  return plan;
}

struct ScatterPlan {
  std::size_t axis;
  Shape in_shape;
  Shape out_shape;  // with the unit axis where untiled
  Shape extents;
};

ScatterPlan plan_reduce_scatter(const Group& g, const char* op, std::span<const std::size_t> shape, int axis, bool tiled, Shape extents) {
  const auto p = static_cast<std::size_t>(g.size());
  ScatterPlan plan;
  plan.in_shape.assign(shape.begin(), shape.end());
  plan.axis = normalize(g, op, "axis", axis, shape.size());
  const std::size_t along = shape[plan.axis];
  if (!tiled) {
    if (!extents.empty()) bad(g, op, "extents are for the tiled form (an untiled reduce_scatter takes one slice per rank)");
    if (along != p) bad(g, op, fmt::format("axis {} has extent {}; untiled, it must be the group's size {}", plan.axis, along, p));
  }
  if (extents.empty()) {
    if (along % p != 0) bad(g, op, fmt::format("axis {} of extent {} does not split into {} equal blocks (pass extents for uneven ones)", plan.axis, along, p));
    extents.assign(p, along / p);
  } else {
    if (extents.size() != p) bad(g, op, fmt::format("extents has {} entries; it needs one per rank of this group of {}", extents.size(), p));
    if (std::accumulate(extents.begin(), extents.end(), std::size_t{0}) != along) {
      bad(g, op, fmt::format("extents {} do not add up to axis {}'s extent {}", extents, plan.axis, along));
    }
  }
  plan.out_shape = plan.in_shape;
  plan.out_shape[plan.axis] = extents[static_cast<std::size_t>(g.rank())];
  plan.extents = std::move(extents);
  return plan;
}

bool all_equal(const Shape& s) { return std::adjacent_find(s.begin(), s.end(), std::not_equal_to<>()) == s.end(); }

std::vector<std::size_t> counts_of(const Blocks& b) {
  std::vector<std::size_t> counts(b.extents.size());
  for (std::size_t i = 0; i < counts.size(); ++i) counts[i] = b.count(i);
  return counts;
}

}  // namespace

// ---- TensorView

std::size_t TensorView::size() const noexcept { return product(shape); }
std::vector<std::ptrdiff_t> TensorView::effective_strides() const { return strides.empty() ? row_major(shape) : strides; }
bool TensorView::contiguous() const noexcept { return is_contiguous(shape, strides); }
std::size_t ConstTensorView::size() const noexcept { return product(shape); }
std::vector<std::ptrdiff_t> ConstTensorView::effective_strides() const { return strides.empty() ? row_major(shape) : strides; }
bool ConstTensorView::contiguous() const noexcept { return is_contiguous(shape, strides); }

// ---- shapes

std::vector<std::size_t> all_gather_shape(std::span<const std::size_t> shape, int axis, int ranks, bool tiled) {
  const Group none;
  if (ranks < 1) bad(none, "all_gather", fmt::format("{} ranks", ranks));
  const auto p = static_cast<std::size_t>(ranks);
  if (tiled) {
    Shape out(shape.begin(), shape.end());
    out[normalize(none, "all_gather", "axis", axis, shape.size())] *= p;
    return out;
  }
  return inserted(Shape(shape.begin(), shape.end()), normalize(none, "all_gather", "axis", axis, shape.size() + 1), p);
}

std::vector<std::size_t> reduce_scatter_shape(std::span<const std::size_t> shape, int axis, int ranks, bool tiled) {
  const Group none;
  if (ranks < 1) bad(none, "reduce_scatter", fmt::format("{} ranks", ranks));
  const auto p = static_cast<std::size_t>(ranks);
  const std::size_t a = normalize(none, "reduce_scatter", "axis", axis, shape.size());
  if (tiled ? shape[a] % p != 0 : shape[a] != p) {
    bad(none, "reduce_scatter", fmt::format("axis {} of extent {} does not {} {} ranks", a, shape[a], tiled ? "split evenly among" : "match", p));
  }
  Shape out(shape.begin(), shape.end());
  if (tiled) {
    out[a] /= p;
    return out;
  }
  return deleted(out, a);
}

std::vector<std::size_t> all_to_all_shape(std::span<const std::size_t> shape, int split_axis, int concat_axis, int ranks, bool tiled) {
  const Group none;
  if (ranks < 1) bad(none, "all_to_all", fmt::format("{} ranks", ranks));
  const auto p = static_cast<std::size_t>(ranks);
  const std::size_t s = normalize(none, "all_to_all", "split_axis", split_axis, shape.size());
  const std::size_t c = normalize(none, "all_to_all", "concat_axis", concat_axis, shape.size());
  if (tiled ? shape[s] % p != 0 : shape[s] != p) {
    bad(none, "all_to_all", fmt::format("split axis {} of extent {} does not {} {} ranks", s, shape[s], tiled ? "split evenly among" : "match", p));
  }
  Shape out(shape.begin(), shape.end());
  if (tiled) {
    out[s] /= p;
    out[c] *= p;
    return out;
  }
  return inserted(deleted(out, s), c, p);
}

// ---- the collectives

Future<void> all_gather(Group& g, ConstTensorView in, TensorView out, int axis, bool tiled, std::vector<std::size_t> extents) {
  const char* op = "all_gather";
  check_view(g, op, "input", in);
  check_types(g, op, in.dtype, out.dtype);
  const GatherPlan plan = plan_gather(g, op, in.shape, axis, tiled, std::move(extents));
  Shape expected = plan.out_shape;
  if (!tiled) expected[plan.axis] = static_cast<std::size_t>(g.size());
  check_output(g, op, out, expected);
  if (!tiled) insert_unit_axis(in, plan.axis);
  const Blocks send = blocks_of(in, plan.in_shape, plan.axis, Shape{plan.in_shape[plan.axis]});
  const Blocks recv = blocks_of(out, plan.out_shape, plan.axis, plan.extents);
  const bool equal = all_equal(plan.extents);
  const auto counts = counts_of(recv);
  return run_blocks(g, op, send, in.device, recv, out.device, in.dtype, send.total(), recv.total(),
                    [&](ConstBufferView s, BufferView o) { return equal ? g.all_gather(s, o) : g.all_gatherv(s, o, counts); });
}

Future<void> reduce_scatter(Group& g, ConstTensorView in, TensorView out, int axis, ReduceOp op_, bool tiled, std::vector<std::size_t> extents) {
  const char* op = "reduce_scatter";
  check_view(g, op, "input", in);
  check_types(g, op, in.dtype, out.dtype);
  const ScatterPlan plan = plan_reduce_scatter(g, op, in.shape, axis, tiled, std::move(extents));
  check_output(g, op, out, tiled ? plan.out_shape : deleted(plan.out_shape, plan.axis));
  if (!tiled) insert_unit_axis(out, plan.axis);
  const Blocks send = blocks_of(in, plan.in_shape, plan.axis, plan.extents);
  const Blocks recv = blocks_of(out, plan.out_shape, plan.axis, Shape{plan.out_shape[plan.axis]});
  const bool equal = all_equal(plan.extents);
  const auto counts = counts_of(send);
  return run_blocks(g, op, send, in.device, recv, out.device, in.dtype, send.total(), recv.total(),
                    [&](ConstBufferView s, BufferView o) { return equal ? g.reduce_scatter(s, o, op_) : g.reduce_scatterv(s, o, counts, op_); });
}

Future<void> all_to_all(Group& g, ConstTensorView in, TensorView out, int split_axis, int concat_axis, bool tiled) {
  const char* op = "all_to_all";
  check_view(g, op, "input", in);
  check_types(g, op, in.dtype, out.dtype);
  const auto p = static_cast<std::size_t>(g.size());
  const std::size_t s = normalize(g, op, "split_axis", split_axis, in.ndim());
  const std::size_t c = normalize(g, op, "concat_axis", concat_axis, in.ndim());
  if (tiled ? in.shape[s] % p != 0 : in.shape[s] != p) {
    bad(g, op, fmt::format("split axis {} has extent {}; {} the group's size {}", s, in.shape[s],
                           tiled ? "tiled, it must be a multiple of" : "untiled, it must be", p));
  }
  check_output(g, op, out, all_to_all_shape(in.shape, split_axis, concat_axis, g.size(), tiled));
  // Both sides as p blocks: the input's along the split axis, the output's along the concat axis. A
  // block's elements in row-major order are the same sequence on both sides (untiled: the unit axes
  // where the split axis was and where the new one is do not change it).
  const Blocks send = blocks_of(in, in.shape, s, Shape(p, in.shape[s] / p));
  const Blocks recv = blocks_of(out, out.shape, c, Shape(p, out.shape[c] / p));
  return run_blocks(g, op, send, in.device, recv, out.device, in.dtype, send.total(), recv.total(),
                    [&](ConstBufferView sb, BufferView o) { return g.all_to_all(sb, o); });
}

Future<void> permute(Group& g, ConstTensorView in, TensorView out, std::vector<std::pair<int, int>> pairs) {
  return same_shape(g, "permute", in, out, [&](ConstBufferView s, BufferView o) { return g.permute(s, o, pairs); });
}

Future<void> all_reduce(Group& g, ConstTensorView in, TensorView out, ReduceOp op) {
  return same_shape(g, "all_reduce", in, out, [&](ConstBufferView s, BufferView o) { return g.all_reduce(s, o, op); });
}

Future<void> broadcast(Group& g, TensorView x, int root) {
  const char* op = "broadcast";
  check_view(g, op, "data", x);
  if (overlaps_itself(x.shape, x.strides)) bad(g, op, fmt::format("data's strides {} make it overlap itself", x.strides));
  const Blocks blocks = whole(x);
  const bool at_root = g.rank() == root;
  if (blocks.in_place()) return g.broadcast(BufferView(x.data, blocks.total(), x.dtype, x.device), root);
  // Staged: the root packs its tensor and sends from the staging; the others receive into it and unpack.
  require_host(g, op, x.device, true);
  auto staging = std::make_shared<Staging>();
  std::byte* packed = room(staging->recv, blocks.total() * dtype_size(x.dtype));
  if (at_root) blocks.pack(packed);
  Future<void> started = g.broadcast(BufferView(packed, blocks.total(), x.dtype), root);
  return spawn(g.loop(), finish(std::move(started), std::move(staging), blocks, !at_root));
}

}  // namespace weft
