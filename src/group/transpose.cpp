#include "weft/transpose.hpp"

#include <cstring>

#include <fmt/format.h>

#include "group/checks.hpp"
#include "group/state.hpp"
#include "weft/error.hpp"
#include "weft/group.hpp"

namespace weft {

namespace {
// The broadcast and reduce transposes write this rank's buffers on the host before their collective (a
// zeroed gradient; the root's copy of its cotangent): checked first, so that a refused call leaves them
// alone, and a null, wrapping, short or device buffer is an error rather than a memset or memcpy out of
// bounds (a non-root broadcast transpose with a null gradient of 8 elements crashed; a reduce transpose
// copied the gradient's size out of a shorter cotangent).
void check_host_write(detail::GroupState& g, const char* op, const char* name, const void* data, std::size_t count, DType dtype,
                      Device device) {
  detail::check_buffer(g, op, name, data, count, dtype, device);
  if (device.kind != Device::Kind::host) {
    detail::invalid(g, op, fmt::format("the {} is device memory, which this transpose writes on the host: zero or copy it on "
                                       "its stream and call the transpose collective (reduce or broadcast) directly", name));
  }
}
}  // namespace

Collective transpose_of(Collective c) noexcept {
  switch (c) {
    case Collective::all_reduce: return Collective::all_reduce;
    case Collective::all_gather: return Collective::reduce_scatter;
    case Collective::reduce_scatter: return Collective::all_gather;
    case Collective::broadcast: return Collective::reduce;
    case Collective::reduce: return Collective::broadcast;
    case Collective::gather: return Collective::scatter;
    case Collective::scatter: return Collective::gather;
    case Collective::all_to_all: return Collective::all_to_all;
    case Collective::permute: return Collective::permute;
    case Collective::barrier: return Collective::barrier;
    case Collective::split: return Collective::split;
    case Collective::all_gatherv: return Collective::reduce_scatterv;
    case Collective::reduce_scatterv: return Collective::all_gatherv;
    case Collective::gatherv: return Collective::scatterv;
    case Collective::scatterv: return Collective::gatherv;
    case Collective::all_to_allv: return Collective::all_to_allv;
  }
  return c;
}

std::vector<std::pair<int, int>> inverse_pairs(const std::vector<std::pair<int, int>>& pairs) {
  std::vector<std::pair<int, int>> out;
  out.reserve(pairs.size());
  for (auto [src, dst] : pairs) out.emplace_back(dst, src);
  return out;
}

Future<void> apply_transpose(Group& group, Collective c, ConstBufferView cotangent, BufferView gradient, ReduceOp op,
                             int root, const std::vector<std::pair<int, int>>& pairs) {
  if (reduces(c) && op != ReduceOp::sum) {
    throw Error(Errc::invalid_argument, ErrorContext{.rank = group.rank(), .op = "apply_transpose"},
                fmt::format("the transpose of {} with op {} is not linear (only sum is)", to_string(c), to_string(op)));
  }
  if (!group.valid()) {
    throw Error(Errc::invalid_argument, ErrorContext{.op = "apply_transpose"}, "this Group is empty: it has no ranks to talk to");
  }
  detail::GroupState& g = *group.state();
  constexpr const char* op_name = "apply_transpose";
  if (c == Collective::broadcast || c == Collective::reduce) detail::check_rank(g, op_name, "root", root);
  if (c == Collective::broadcast && group.rank() != root) {
    check_host_write(g, op_name, "gradient", gradient.data, gradient.count, gradient.dtype, gradient.device);
  }
  if (c == Collective::reduce && group.rank() == root) {
    check_host_write(g, op_name, "gradient", gradient.data, gradient.count, gradient.dtype, gradient.device);
    check_host_write(g, op_name, "cotangent", cotangent.data, cotangent.count, cotangent.dtype, cotangent.device);
    detail::check_same_type(g, op_name, cotangent.dtype, gradient.dtype);
    detail::check_count(g, op_name, "the cotangent", cotangent.count, gradient.count);
  }
  switch (c) {
    case Collective::all_reduce: return group.all_reduce(cotangent, gradient, ReduceOp::sum);
    case Collective::all_gather: return group.reduce_scatter(cotangent, gradient, ReduceOp::sum);
    case Collective::reduce_scatter: return group.all_gather(cotangent, gradient);
    case Collective::broadcast:
      // Only the root's input reached the outputs: elsewhere the gradient is zero.
      if (group.rank() != root && gradient.bytes()) std::memset(gradient.data, 0, gradient.bytes());
      return group.reduce(cotangent, group.rank() == root ? gradient : BufferView(nullptr, 0, gradient.dtype), root,
                          ReduceOp::sum);
    case Collective::reduce: {
      // Every rank's gradient is the root's cotangent.
      if (group.rank() == root && gradient.bytes()) std::memcpy(gradient.data, cotangent.data, gradient.bytes());
      return group.broadcast(gradient, root);
    }
    case Collective::gather: return group.scatter(cotangent, gradient, root);
    case Collective::scatter: return group.gather(cotangent, gradient, root);
    case Collective::all_to_all: return group.all_to_all(cotangent, gradient);
    case Collective::permute: return group.permute(cotangent, gradient, inverse_pairs(pairs));
    case Collective::barrier: return group.barrier();
    case Collective::split: break;
    case Collective::all_gatherv:
    case Collective::reduce_scatterv:
    case Collective::gatherv:
    case Collective::scatterv:
    case Collective::all_to_allv:
      throw Error(Errc::invalid_argument, ErrorContext{.rank = group.rank(), .op = "apply_transpose"},
                  fmt::format("the transpose of {} needs its per-rank counts: call {} with the same counts (sends and "
                              "receives swapped for all_to_allv)", to_string(c), to_string(transpose_of(c))));
  }
  throw Error(Errc::invalid_argument, ErrorContext{.rank = group.rank(), .op = "apply_transpose"},
              fmt::format("{} has no transpose (it is not a linear map of buffers)", to_string(c)));
}

}  // namespace weft
