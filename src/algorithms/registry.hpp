#pragma once
// Every algorithm this build implements, by collective: the one list that the selection table,
// WEFT_ALGO, tuning files, weft-bench --tune and Group's dispatch read. An algorithm is a (collective,
// kind) pair with the name users write; Group switches on the kind, so a name that is not here cannot
// run (a name absent from the dispatch fails loudly rather than running an empty plan).
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "weft/collective.hpp"

namespace weft::algorithms {

/// Algorithm families; several collectives have a ring, a binomial tree, ...
enum class Kind : std::uint8_t {
  ring,
  bidirectional_ring,
  recursive_doubling,
  rabenseifner,
  tree,
  bruck,
  recursive_halving,
  binomial,
  scatter_all_gather,
  chain,
  reduce_scatter_gather,
  direct,
  pairwise,
  dissemination,
  shm,  // the direct shared-memory collectives (group arena): groups whose ranks share one host
  // (shm stays last: registry.cpp sizes its table of entries by it)
};

struct Algorithm {
  Collective collective;
  Kind kind;
  std::string_view name;  // as WEFT_ALGO and tuning files write it
};

/// Every entry, grouped by collective in Collective order; within one, the first is the fallback.
std::span<const Algorithm> registry() noexcept;
/// The entry (collective, name), or null.
const Algorithm* find(Collective collective, std::string_view name) noexcept;
/// The entry (collective, kind). Errors: std::logic_error when there is none (a table of this build
/// names what it does not implement: a bug the registry test catches).
const Algorithm& entry(Collective collective, Kind kind);
/// The entry (collective, kind), or null (a kind a peer named that this collective does not have).
const Algorithm* find_kind(Collective collective, Kind kind) noexcept;
/// The names of `collective`'s algorithms, in registry order (empty: the collective has no choice).
const std::vector<std::string_view>& names_for(Collective collective);

}  // namespace weft::algorithms
