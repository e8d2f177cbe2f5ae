#pragma once
// What the launcher says about this host: how many ranks it started here.
namespace weft::host {

/// The ranks sharing this host, from the launcher's environment (WEFT_LOCAL_WORLD_SIZE from weft-run,
/// LOCAL_WORLD_SIZE from torchrun, OMPI_COMM_WORLD_LOCAL_SIZE, SLURM_NTASKS_PER_NODE); 1 when none says.
int local_ranks() noexcept;

}  // namespace weft::host
