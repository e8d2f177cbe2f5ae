#include "algorithms/registry.hpp"

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace weft::algorithms {
namespace {

using C = Collective;
using K = Kind;

constexpr Algorithm entries[] = {
    {C::all_reduce, K::ring, "ring"},
    {C::all_reduce, K::bidirectional_ring, "bidirectional_ring"},
    {C::all_reduce, K::recursive_doubling, "recursive_doubling"},
    {C::all_reduce, K::rabenseifner, "rabenseifner"},
    {C::all_reduce, K::tree, "tree"},
    {C::all_reduce, K::shm, "shm"},
    {C::all_gather, K::ring, "ring"},
    {C::all_gather, K::bruck, "bruck"},
    {C::all_gather, K::recursive_doubling, "recursive_doubling"},
    {C::all_gather, K::shm, "shm"},
    {C::reduce_scatter, K::ring, "ring"},
    {C::reduce_scatter, K::recursive_halving, "recursive_halving"},
    {C::reduce_scatter, K::shm, "shm"},
    {C::broadcast, K::binomial, "binomial"},
    {C::broadcast, K::scatter_all_gather, "scatter_all_gather"},
    {C::broadcast, K::chain, "chain"},
    {C::broadcast, K::shm, "shm"},
    {C::reduce, K::binomial, "binomial"},
    {C::reduce, K::reduce_scatter_gather, "reduce_scatter_gather"},
    {C::gather, K::direct, "direct"},
    {C::gather, K::binomial, "binomial"},
    {C::scatter, K::direct, "direct"},
    {C::scatter, K::binomial, "binomial"},
    {C::all_to_all, K::pairwise, "pairwise"},
    {C::all_to_all, K::bruck, "bruck"},
    {C::all_to_all, K::shm, "shm"},
    {C::barrier, K::dissemination, "dissemination"},
    {C::barrier, K::shm, "shm"},
    // permute and split have one plan each and no choice to make.
    // The variable-size forms (the names WEFT_ALGO and algorithm_for use); all_gatherv's Bruck pads the
    // blocks to the largest.
    {C::all_gatherv, K::ring, "ring"},
    {C::all_gatherv, K::bruck, "bruck"},
    {C::gatherv, K::direct, "direct"},
    {C::scatterv, K::direct, "direct"},
    {C::all_to_allv, K::pairwise, "pairwise"},
    {C::reduce_scatterv, K::ring, "ring"},
};

// Grouped by collective in Collective order: names_for and the fallback depend on it.
constexpr bool grouped() {
  for (std::size_t i = 1; i < std::size(entries); ++i) {
    if (static_cast<int>(entries[i].collective) < static_cast<int>(entries[i - 1].collective)) return false;
  }
  return true;
}
static_assert(grouped(), "registry entries must be grouped by collective, in Collective order");

}  // namespace

std::span<const Algorithm> registry() noexcept { return entries; }

const Algorithm* find(Collective collective, std::string_view name) noexcept {
  for (const Algorithm& a : registry()) {
    if (a.collective == collective && a.name == name) return &a;
  }
  return nullptr;
}

// entry() runs on every collective call (the selection's answer): a table built at compile time, not a
// search of the registry.
constexpr std::size_t kinds = static_cast<std::size_t>(Kind::shm) + 1;
constexpr auto entry_index = [] {
  std::array<std::array<std::int8_t, kinds>, all_collectives.size()> index{};
  for (auto& row : index) row.fill(-1);
  for (std::size_t i = 0; i < std::size(entries); ++i) {
    index[static_cast<std::size_t>(entries[i].collective)][static_cast<std::size_t>(entries[i].kind)] = static_cast<std::int8_t>(i);
  }
  return index;
}();
static_assert(std::size(entries) < 128, "entry_index holds entries' positions in an int8_t");

const Algorithm& entry(Collective collective, Kind kind) {
  if (const Algorithm* found = find_kind(collective, kind)) return *found;
  throw std::logic_error("weft: no algorithm of kind " + std::to_string(static_cast<int>(kind)) + " for " +
                         std::string(to_string(collective)) + " in the registry");
}

const Algorithm* find_kind(Collective collective, Kind kind) noexcept {
  const auto c = static_cast<std::size_t>(collective);
  const auto k = static_cast<std::size_t>(kind);
  return c < entry_index.size() && k < kinds && entry_index[c][k] >= 0 ? &entries[static_cast<std::size_t>(entry_index[c][k])] : nullptr;
}

const std::vector<std::string_view>& names_for(Collective collective) {
  static const auto names = [] {
    std::array<std::vector<std::string_view>, all_collectives.size()> out;
    for (const Algorithm& a : registry()) out[static_cast<std::size_t>(a.collective)].push_back(a.name);
    return out;
  }();
  return names[static_cast<std::size_t>(collective)];
}

}  // namespace weft::algorithms
