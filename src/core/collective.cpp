#include "weft/collective.hpp"

namespace weft {

std::string_view to_string(Collective c) noexcept {
  switch (c) {
    case Collective::all_reduce: return "all_reduce";
    case Collective::all_gather: return "all_gather";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::broadcast: return "broadcast";
    case Collective::reduce: return "reduce";
    case Collective::gather: return "gather";
    case Collective::scatter: return "scatter";
    case Collective::all_to_all: return "all_to_all";
    case Collective::barrier: return "barrier";
    case Collective::permute: return "permute";
    case Collective::split: return "split";
    case Collective::all_gatherv: return "all_gatherv";
    case Collective::gatherv: return "gatherv";
    case Collective::scatterv: return "scatterv";
    case Collective::all_to_allv: return "all_to_allv";
    case Collective::reduce_scatterv: return "reduce_scatterv";
  }
  return "?";
}

std::optional<Collective> collective_named(std::string_view name) noexcept {
  for (Collective c : all_collectives) {
    if (to_string(c) == name) return c;
  }
  return std::nullopt;
}

}  // namespace weft
