#pragma once
/// The collectives weft runs, by identity: one vocabulary for the API, the algorithm registry, the
/// selection table, WEFT_ALGO and tuning files, and the signatures frames carry.
#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

namespace weft {

/// The order is part of the wire protocol (a data frame's signature packs the value + 1,
/// docs/PROTOCOL.md "Signatures"): append, never renumber.
enum class Collective : std::uint8_t {
  all_reduce,
  all_gather,
  reduce_scatter,
  broadcast,
  reduce,
  gather,
  scatter,
  all_to_all,
  barrier,
  permute,
  split,  // Group::split's exchange of colors and keys
  // The variable-size forms (MPI's v-collectives): a count per rank instead of one.
  all_gatherv,
  gatherv,
  scatterv,
  all_to_allv,
  reduce_scatterv,
};

/// Every collective, in order.
inline constexpr std::array<Collective, 16> all_collectives = {
    Collective::all_reduce,  Collective::all_gather, Collective::reduce_scatter, Collective::broadcast,
    Collective::reduce,      Collective::gather,     Collective::scatter,        Collective::all_to_all,
    Collective::barrier,     Collective::permute,    Collective::split,          Collective::all_gatherv,
    Collective::gatherv,     Collective::scatterv,   Collective::all_to_allv,    Collective::reduce_scatterv};

/// "all_reduce", ... as the API, WEFT_ALGO and the error messages spell them.
std::string_view to_string(Collective c) noexcept;
/// The collective `name` spells, or nullopt.
std::optional<Collective> collective_named(std::string_view name) noexcept;

/// Whether `c` combines its inputs with a reduce op (all_reduce, reduce_scatter, reduce, reduce_scatterv).
constexpr bool reduces(Collective c) noexcept {
  return c == Collective::all_reduce || c == Collective::reduce_scatter || c == Collective::reduce ||
         c == Collective::reduce_scatterv;
}

/// Whether `c` takes a count per rank (all_gatherv, gatherv, scatterv, all_to_allv, reduce_scatterv).
constexpr bool variable_size(Collective c) noexcept {
  return c == Collective::all_gatherv || c == Collective::gatherv || c == Collective::scatterv ||
         c == Collective::all_to_allv || c == Collective::reduce_scatterv;
}

}  // namespace weft
