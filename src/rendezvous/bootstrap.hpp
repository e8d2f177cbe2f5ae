#pragma once
// Bootstrap: meet at the store, exchange listening addresses, connect every pair of ranks, handshake.
#include <memory>
#include <vector>

#include <asio.hpp>

#include "core/frame_keys.hpp"
#include "rendezvous/store.hpp"
#include "weft/options.hpp"

namespace weft {

struct BootstrapResult {
  std::vector<asio::ip::tcp::socket> sockets;  // [peer], handshaken; [rank] unused
  std::vector<FrameKeys> frame_keys;            // [peer], from the greeting (zeros without a secret)
  std::unique_ptr<store::Server> store_server;  // rank 0 only
};

/// Runs the whole rendezvous on `executor` (its Loop's: detail::executor_of), where it makes its sockets,
/// timers and the store's server. `options` must be complete (rank, world size, store). `selection`:
/// the digest of what shapes this rank's plans (its algorithm selection, segment size, deterministic
/// reductions: group/create.cpp), which every rank's must equal.
/// Errors: weft::Error naming this rank and "bootstrap"; a TimeoutError names the ranks that never arrived;
/// a refusal (Errc::refused) says what a rank and the store or a peer disagree on.
asio::awaitable<void> bootstrap(asio::any_io_executor executor, const Options& options, BootstrapResult& out, std::uint64_t selection = 0);

/// The local address to bind for `interface` (a name such as "eth0", or an address). Errors: weft::Error.
asio::ip::address interface_address(const std::string& interface, bool prefer_v6);

}  // namespace weft
