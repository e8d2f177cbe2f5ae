#pragma once
// Linking the ranks of one host (shared memory), right after the bootstrap and before the transport:
// over every peer's connection (authenticated by the greeting) both ranks send a 64-byte link offer
// (docs/PROTOCOL.md, "Link offer"): whether they want shared memory, their host (boot id and network
// namespace), uid and pid, and a nonce. Where both want it and both are on one host as one user, the
// lower rank listens on an abstract unix socket named by its nonce and the higher connects; each checks
// the other's credentials (SO_PEERCRED: the pid the offer declared), makes its inbound ring and sends it
// with its eventfd (SCM_RIGHTS); both say over the TCP connection whether all went well, and the pair
// uses shared memory only if both did. Anything else keeps the TCP connection, with one log line.
// Over the unix socket each also probes whether it can read the other's memory (process_vm_readv):
// large writes then go by single copy (ring.hpp's reference records), else through the ring.
#include <chrono>
#include <memory>
#include <optional>
#include <vector>

#include <asio.hpp>

#include "transports/shm/shm_stream.hpp"

namespace weft::shm {

/// Ring capacity per direction, chosen by the receiver for its inbound rings from the number of peers
/// it links on this host (docs/DESIGN.md quotes these by name): `ring_bytes_most` while its inbound
/// rings fit in `inbound_ring_budget` (up to 16 peers), then the largest power of two that keeps them
/// inside it, never below `ring_bytes_least`. A flat 1 MiB put N(N-1) MiB of populated shared memory on
/// a host of N ranks: 4 GiB at 64, 16 GiB at 128 (Open MPI's vader takes 4 MiB a process).
inline constexpr std::size_t ring_bytes_most = std::size_t{1} << 20;
inline constexpr std::size_t ring_bytes_least = std::size_t{64} << 10;
inline constexpr std::size_t inbound_ring_budget = std::size_t{16} << 20;
std::size_t ring_bytes_for(std::size_t local_peers) noexcept;
/// Single copy is off unless WEFT_SHM_CMA_BYTES names the smallest write to send by it: on these
/// machines it measured slower than the rings at every size and in every pattern (ping-pong, streaming,
/// all_reduce: bench/RESULTS.md, "Single copy"), so the rings are the default.
inline constexpr std::size_t default_single_copy_bytes = 0;

/// For every peer of `sockets` (sockets[rank] unused): its Link when the pair uses shared memory, else
/// nullopt. `want`: this rank offers shared memory; `wake_fd`: its ShmHub's eventfd. Every rank of the
/// job must call it (the offer is part of every connection's protocol). Runs until `deadline` at most.
/// `same_host` (resized to the ranks) says, for every peer, whether its host identity (boot id and
/// network namespace) is this rank's, whether or not either wants shared memory: both sides of a pair
/// decide it from the same two offers.
/// Errors: a peer that sends no offer, or a malformed one, throws (the connection is broken).
asio::awaitable<std::vector<std::optional<ShmStream::Link>>> link_local_peers(std::vector<asio::ip::tcp::socket>& sockets, int rank,
                                                                              bool want, int wake_fd,
                                                                              std::chrono::steady_clock::time_point deadline,
                                                                              std::vector<bool>& same_host);

class Arena;

/// After link_local_peers, over the unix sockets of `links`: the group arena (arena.hpp) of a job whose
/// every rank is linked to every other. Each rank tells rank 0 whether it is linked to all; rank 0 makes
/// the arena only if all are, and passes it (SCM_RIGHTS); each rank confirms it mapped it, and rank 0
/// says whether every rank did (docs/PROTOCOL.md, "Group arena"). Null where there is none; every step
/// waits at most `timeout_ms`. Every rank linked to rank 0 must call it.
std::shared_ptr<Arena> share_arena(std::vector<std::optional<ShmStream::Link>>& links, int rank, int timeout_ms);

/// This host as the offer names it: the kernel's boot id and this process's network namespace.
std::array<std::byte, 24> host_identity();

}  // namespace weft::shm
