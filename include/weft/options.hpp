#pragma once
/// Options of a Group. Anything left unset comes from the environment (see from_environment), then from
/// the defaults below.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace weft {

/// The longest duration weft takes (timeout, heartbeat, bootstrap_timeout, their variables): a year.
/// Deadlines are kept in nanoseconds on a steady clock; a longer one would wrap. Longer: an error.
inline constexpr std::chrono::milliseconds max_duration{std::chrono::hours(24 * 365)};

/// What every frame between ranks carries to prove its bytes arrived as sent (Options::integrity).
enum class Integrity : std::uint8_t {
  off = 0,     // nothing: TCP's own checksum only
  crc32c = 1,  // a CRC-32C of each frame: corruption is caught, tampering is not
  hmac = 2,    // an HMAC-SHA256 of each frame keyed from the shared secret: corruption and tampering are caught
};

/// "off", "crc32c", "hmac": as WEFT_INTEGRITY spells them.
constexpr std::string_view to_string(Integrity mode) noexcept {
  switch (mode) {
    case Integrity::off: return "off";
    case Integrity::crc32c: return "crc32c";
    case Integrity::hmac: return "hmac";
  }
  return "?";
}

struct Options {
  /// This process's rank and the number of ranks. -1: from the environment.
  int rank = -1;
  int world_size = -1;
  /// The rendezvous store, "host:port" ("[v6addr]:port" for IPv6). Rank 0 serves it. Empty: from the
  /// environment, else 127.0.0.1:29500.
  std::string store;
  /// Where this rank listens for its peers: an interface name ("eth0") or an address. Empty: WEFT_IFNAME,
  /// else the local address this rank uses to reach the store. Sockets bind only there.
  std::string interface;
  /// How long the bootstrap may take before it fails, naming the ranks that never arrived.
  std::chrono::milliseconds bootstrap_timeout{std::chrono::seconds(120)};
  /// A step's data travels in segments of this many bytes, `pipeline_depth` in flight.
  std::size_t segment_bytes = 256 * 1024;
  int pipeline_depth = 8;
  /// Device buffers (weft/gpu.hpp) of a large all_reduce or broadcast are copied to and from their host
  /// staging in pieces of this many bytes (WEFT_STAGING_COPY_BYTES), so that the network starts on the
  /// first piece while the rest is still copying and each finished range goes back at once. 0: one copy
  /// each way, before and after the transfers.
  std::size_t staging_copy_bytes = 2 << 20;
  /// Algorithm choices overriding the built-in table, e.g.
  /// "all_reduce:recursive_doubling@0-16K,rabenseifner@16K-1M,ring" (WEFT_ALGO; syntax in README).
  std::string algorithms;
  /// A tuning file written by `weft-bench --tune` (WEFT_TUNING): algorithm choices in WEFT_ALGO's syntax,
  /// applied before `algorithms`. An unreadable or malformed file is an error naming it.
  std::string tuning_file;
  /// Deterministic reductions (WEFT_DETERMINISTIC=1): every element is reduced in rank order,
  /// ((x0 op x1) op x2) ..., so results are bitwise the same on every rank for every algorithm, segment
  /// size and message size. all_reduce and reduce_scatter then exchange blocks (the same traffic as the
  /// ring) and reduce locally; reduce runs a deterministic all_reduce. Cost: bench/RESULTS.md.
  bool deterministic = false;
  /// How bytes move between ranks (WEFT_TRANSPORT): "tcp" (Asio's reactor), "uring" (io_uring), "shm"
  /// (shared memory with the ranks of this host that ask for it too, tcp with the others; when every
  /// rank of the job is on this host, also the group arena of the direct shm collectives), "shm+uring"
  /// (the same with io_uring for the others), or "auto" (what measured fastest: shared memory where it
  /// can, tcp with the others; io_uring measured slower, docs/DESIGN.md). They speak the same protocol, so ranks may differ. When io_uring
  /// cannot be set up, weft uses tcp and says so once in the log; a pair that cannot share memory stays
  /// on TCP with one log line. Empty: WEFT_TRANSPORT, else "auto" (so ranks that any launcher starts on
  /// one host share memory; weft-run sets "shm", which is the same).
  /// Any other value is an error naming the valid ones.
  std::string transport;
  /// Every collective's deadline (WEFT_TIMEOUT: "500ms", "30s", "2m", "1h"; a bare number is seconds;
  /// 0: none). When it passes, the operation fails on this rank with Errc::timeout and a report of the
  /// ranks it was still waiting for, and on every other rank of the group (an abort frame carries the
  /// report); the group is failed afterwards. Default 30 minutes. A deadline passes up to a quarter of
  /// itself late (at most 250 ms; 500 ms from 10 s on, where it is counted from the watchdog's first look
  /// after the call, sparing every call a clock read; more while the loop's thread is kept busy by a
  /// handler of the application's), never early.
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  /// At most this many bytes of messages that arrive before their receive is posted are kept, all peers
  /// together (WEFT_MAX_EARLY_BYTES). A message beyond it fails the sender's connection with an error
  /// naming the sizes, so a forged or runaway length cannot exhaust memory. 0 (the default): half of the
  /// machine's physical memory divided among the ranks the launcher put on the host
  /// (WEFT_LOCAL_WORLD_SIZE, LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, SLURM_NTASKS_PER_NODE), at
  /// least 1 GiB.
  std::size_t max_early_bytes = 0;
  /// Heartbeats (WEFT_HEARTBEAT, a duration; 0: off): after this much silence the peer's host is probed,
  /// every interval, and the connection fails after 3 unanswered probes or when sent data stays
  /// unacknowledged for 4 intervals, failing every pending operation with PeerFailure ("... the peer did
  /// not acknowledge heartbeats ..."). This catches a host that went down or a cut network, which no
  /// error reports otherwise. A live peer that does not read (busy, stopped: a zero window) still
  /// acknowledges, and is never failed by this; its lateness is the deadline's to catch. At least 1 s
  /// (the kernel's keepalive interval is whole seconds); a shorter one is refused by Group::create.
  std::chrono::milliseconds heartbeat{std::chrono::seconds(5)};
  /// A shared secret (WEFT_SECRET, or the contents of the file WEFT_SECRET_FILE names, without a final
  /// newline). When set, every connection (to the store and between ranks) runs a mutual HMAC-SHA256
  /// challenge-response before anything else, and a process without the same secret is refused and
  /// logged with its address. Empty: connections are unauthenticated (said once in the log). Every rank
  /// of a job must agree. The secret is never logged nor sent.
  std::string secret;
  /// Keeps two jobs apart that could reach each other's store or ranks (WEFT_JOB_ID, else SLURM_JOB_ID,
  /// else TORCHELASTIC_RUN_ID; weft-run makes one per launch). A connection of another job is refused,
  /// naming both ids. At most 255 bytes. Empty: no job id (only processes without one match).
  std::string job_id;
  /// Frame integrity (WEFT_INTEGRITY: off, crc32c or hmac). Every frame between ranks then ends with a
  /// CRC-32C (4 bytes), or with an HMAC-SHA256 truncated to 16 bytes over a frame counter, the header
  /// and the payload, keyed per connection and direction from the secret (hmac needs `secret`). A frame
  /// whose trailer does not match fails its connection like a lost peer, with an error naming the peer
  /// and the frame. Every rank must agree (a rank that does not is refused at the greeting). Cost per
  /// size: bench/RESULTS.md. Default off: TCP's checksum only.
  Integrity integrity = Integrity::off;

  /// Fills what is unset from the environment, in this order: WEFT_RANK / WEFT_WORLD_SIZE / WEFT_STORE;
  /// torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; Open MPI's OMPI_COMM_WORLD_RANK /
  /// OMPI_COMM_WORLD_SIZE; PMI_RANK / PMI_SIZE; SLURM_PROCID / SLURM_NTASKS. Also WEFT_IFNAME,
  /// WEFT_BOOTSTRAP_TIMEOUT (seconds), WEFT_SEGMENT_BYTES, WEFT_PIPELINE_DEPTH, WEFT_STAGING_COPY_BYTES, WEFT_ALGO, WEFT_TUNING, WEFT_DETERMINISTIC, WEFT_TRANSPORT,
  /// WEFT_MAX_EARLY_BYTES, WEFT_TIMEOUT, WEFT_SECRET / WEFT_SECRET_FILE, WEFT_JOB_ID, WEFT_HEARTBEAT, WEFT_INTEGRITY.
  /// Errors: weft::Error (invalid_argument) for a malformed value or a missing rank / world size; the message
  /// names the variable.
  Options& from_environment();
  /// Like from_environment, reading variables through `getenv` (for tests).
  Options& from_environment(const std::function<const char*(const char*)>& getenv);
};

/// host and port of "host:port" or "[v6]:port". Errors: weft::Error (invalid_argument) naming `what`.
struct HostPort {
  std::string host;
  unsigned short port = 0;
};
HostPort parse_host_port(const std::string& text, const char* what);

}  // namespace weft
