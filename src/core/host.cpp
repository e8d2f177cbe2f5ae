#include "core/host.hpp"

#include <cstdlib>
#include <initializer_list>

namespace weft::host {

int local_ranks() noexcept {
  for (const char* name : {"WEFT_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"}) {
    if (const char* v = std::getenv(name); v && std::atoi(v) > 0) return std::atoi(v);
  }
  return 1;
}

}  // namespace weft::host
