#include "core/signature.hpp"

#include <algorithm>
#include <array>
#include <atomic>

#include <fmt/format.h>

namespace weft::signature {
namespace {

// Kind codes are part of the wire protocol: the Collective's value + 1 (its order is append-only).
// 0: not a collective (unchecked).
constexpr std::uint32_t plan_kind = 31;  // a user's plan (Group::run_plan), whatever its name
constexpr std::uint32_t device_windows_kind = 30;  // all_reduce on device windows (one host's processes)
static_assert(all_collectives.size() < point_to_point_kind);  // (signature.hpp)

constexpr std::uint32_t root_bits = 18;
constexpr std::uint32_t no_root = 0;

OpSignature pack(std::uint32_t kind, bool reducing, DType dtype, ReduceOp op, std::uint64_t count, int root) {
  const std::uint32_t type = static_cast<std::uint32_t>(dtype) + 1;
  const std::uint32_t reduce = reducing ? static_cast<std::uint32_t>(op) + 1 : 0;
  // Roots beyond 2^18 - 2 (no group is that large today) share the top code: still compared, named vaguely.
  const std::uint32_t root_code =
      root < 0 ? no_root : std::min<std::uint32_t>(static_cast<std::uint32_t>(root) + 1, (1u << root_bits) - 1);
  return OpSignature{.call = kind << 27 | type << 22 | reduce << 18 | root_code, .count = count};
}

}  // namespace

OpSignature of(Collective collective, DType dtype, ReduceOp op, std::uint64_t count, int root) {
  return pack(static_cast<std::uint32_t>(collective) + 1, reduces(collective), dtype, op, count, root);
}

OpSignature of_plan(DType dtype, ReduceOp op, std::uint64_t count) { return pack(plan_kind, true, dtype, op, count, -1); }
OpSignature of_device_windows(DType dtype, ReduceOp op, std::uint64_t count) {
  return pack(device_windows_kind, true, dtype, op, count, -1);
}

OpSignature of_point_to_point(DType dtype) {
  if (dtype == DType::u8) return {};
  return pack(point_to_point_kind, false, dtype, ReduceOp::sum, 0, -1);
}

std::string dtype_of(const OpSignature& signature) {
  const std::uint32_t type = (signature.call >> 22) & 31;
  return type >= 1 && type <= 13 ? std::string(to_string(static_cast<DType>(type - 1))) : fmt::format("type {}", type);
}

std::uint64_t counts_digest(std::span<const std::size_t> counts) noexcept {
  // FNV-1a over each count's 8 little-endian bytes, and the number of counts.
  std::uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](std::uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ull;
    }
  };
  for (std::size_t c : counts) mix(c);
  mix(counts.size());
  return h;
}

namespace {
std::atomic<PlanNamer> plan_namer{nullptr};
}  // namespace

void set_plan_namer(PlanNamer namer) noexcept { plan_namer.store(namer, std::memory_order_release); }

std::string describe(const OpSignature& s, std::uint64_t seq) {
  const std::uint32_t kind = s.call >> 27;
  if (kind == point_to_point_kind) return fmt::format("a message of {}", dtype_of(s));
  const std::uint32_t reduce = (s.call >> 18) & 15;
  const std::uint32_t root = s.call & ((1u << root_bits) - 1);
  const std::string_view name = kind >= 1 && kind <= all_collectives.size() ? to_string(static_cast<Collective>(kind - 1))
                                : kind == plan_kind                      ? "a plan"
                                : kind == device_windows_kind            ? "all_reduce on device windows"
                                                                         : "an unknown collective";
  std::string detail = dtype_of(s);
  // The variable-size collectives carry a digest of their per-rank counts (counts_digest), not a count.
  const bool digest = kind >= 1 && kind <= all_collectives.size() && variable_size(static_cast<Collective>(kind - 1));
  detail += digest ? fmt::format(", counts digest {:016x}", s.count) : fmt::format(" x {}", s.count);
  if (root != no_root) detail += fmt::format(", root {}", root - 1);
  if (reduce >= 1 && reduce <= 10) detail += fmt::format(", {}", to_string(static_cast<ReduceOp>(reduce - 1)));
  std::string plan;
  if (s.plan != 0) {
    const PlanNamer namer = plan_namer.load(std::memory_order_acquire);
    const std::string_view named = namer && kind >= 1 && kind <= all_collectives.size() ? namer(static_cast<Collective>(kind - 1), s.plan)
                                                                                        : std::string_view();
    plan = named.empty() ? fmt::format(" as plan {}", s.plan) : fmt::format(" as {}", named);
  }
  return fmt::format("{} #{} ({}){}", name, seq, detail, plan);
}

}  // namespace weft::signature
