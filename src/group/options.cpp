#include <charconv>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "core/env.hpp"
#include "weft/error.hpp"
#include "weft/options.hpp"

namespace weft {
namespace {

[[noreturn]] void bad(const std::string& detail) {
  throw Error(Errc::invalid_argument, ErrorContext{.op = "configuration"}, detail);
}

long long parse_int(const char* name, const char* text, long long lo, long long hi) {
  long long value = 0;
  const char* end = text + std::char_traits<char>::length(text);
  auto [ptr, ec] = std::from_chars(text, end, value);
  if (ec != std::errc() || ptr != end || text == end) {
    bad(fmt::format("{}='{}' is not an integer", name, text));
  }
  if (value < lo || value > hi) bad(fmt::format("{}={} is out of range [{}, {}]", name, value, lo, hi));
  return value;
}

// The secret in `path`, without a final newline. An unreadable or empty file is an error naming it.
std::string read_secret_file(const char* path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) bad(fmt::format("WEFT_SECRET_FILE='{}' cannot be read", path));
  std::stringstream text;
  text << in.rdbuf();
  std::string secret = text.str();
  while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
  if (secret.empty()) bad(fmt::format("WEFT_SECRET_FILE='{}' is empty", path));
  return secret;
}

struct Convention {
  const char* rank;
  const char* size;
};
constexpr Convention conventions[] = {
    {"WEFT_RANK", "WEFT_WORLD_SIZE"},
    {"RANK", "WORLD_SIZE"},
    {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
    {"PMI_RANK", "PMI_SIZE"},
    {"SLURM_PROCID", "SLURM_NTASKS"},
};

}  // namespace

HostPort parse_host_port(const std::string& text, const char* what) {
  HostPort out;
  std::string port;
  if (!text.empty() && text.front() == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      bad(fmt::format("{}='{}': expected [ipv6-address]:port", what, text));
    }
    out.host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos || colon == 0) bad(fmt::format("{}='{}': expected host:port", what, text));
    if (text.find(':') != colon) bad(fmt::format("{}='{}': write an IPv6 address as [address]:port", what, text));
    out.host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  out.port = static_cast<unsigned short>(parse_int(what, port.c_str(), 0, 65535));
  return out;
}

Options& Options::from_environment() { return from_environment([](const char* name) { return std::getenv(name); }); }

Options& Options::from_environment(const std::function<const char*(const char*)>& env) {
  if (rank < 0 || world_size < 0) {
    for (const auto& c : conventions) {
      const char* r = env(c.rank);
      const char* s = env(c.size);
      if (!r && !s) continue;
      if (!r || !s) bad(fmt::format("{} and {} must be set together", c.rank, c.size));
      if (world_size < 0) world_size = static_cast<int>(parse_int(c.size, s, 1, 1 << 24));
      if (rank < 0) rank = static_cast<int>(parse_int(c.rank, r, 0, world_size - 1));
      break;
    }
  }
  if (rank < 0 || world_size < 0) {
    // Say which is missing: Options (or Python's Group.create) may have given the other.
    const char* missing = rank < 0 && world_size < 0 ? "no rank and world size" : rank < 0 ? "no rank (the world size was given)"
                                                                                           : "no world size (the rank was given)";
    bad(fmt::format("{}: set WEFT_RANK and WEFT_WORLD_SIZE, or both Options (or run under weft-run, torchrun, mpirun or srun)", missing));
  }
  if (rank >= world_size) bad(fmt::format("rank {} is not below the world size {}", rank, world_size));
  if (store.empty()) {
    if (const char* s = env("WEFT_STORE")) {
      store = s;
    } else if (env("MASTER_ADDR") || env("MASTER_PORT")) {
      const char* addr = env("MASTER_ADDR");
      const char* port = env("MASTER_PORT");
      std::string host = addr ? addr : "127.0.0.1";
      if (host.find(':') != std::string::npos && host.front() != '[') host = "[" + host + "]";
      store = host + ":" + (port ? port : "29500");
    } else {
      store = "127.0.0.1:29500";
    }
  }
  if (parse_host_port(store, "the store address").port == 0 && world_size > 1) {
    // Rank 0 would serve on a port the kernel picks, which no other rank can know.
    bad(fmt::format("the store address='{}' has port 0: every rank must know the store's port before rank 0 serves it "
                    "(pick a free one; weft-run does)", store));
  }
  if (interface.empty()) {
    if (const char* v = env("WEFT_IFNAME")) interface = v;
  }
  if (const char* v = env("WEFT_BOOTSTRAP_TIMEOUT")) {
    bootstrap_timeout = std::chrono::seconds(parse_int("WEFT_BOOTSTRAP_TIMEOUT", v, 1, 86400));
  }
  if (const char* v = env("WEFT_SEGMENT_BYTES")) {
    segment_bytes = static_cast<std::size_t>(parse_int("WEFT_SEGMENT_BYTES", v, 1024, 1ll << 32));
  }
  if (const char* v = env("WEFT_DETERMINISTIC")) deterministic = deterministic || parse_int("WEFT_DETERMINISTIC", v, 0, 1) == 1;
  if (tuning_file.empty()) {
    if (const char* v = env("WEFT_TUNING")) tuning_file = v;
  }
  if (algorithms.empty()) {
    if (const char* v = env("WEFT_ALGO")) algorithms = v;
  }
  if (transport.empty()) {
    if (const char* v = env("WEFT_TRANSPORT")) transport = v;
  }
  // Shared memory with the ranks of this host, TCP with the others: what a user of mpirun, torchrun or
  // srun gets without asking, as Open MPI's vader and NCCL's SHM transport are their defaults.
  if (transport.empty()) transport = "auto";
  if (transport != "tcp" && transport != "uring" && transport != "auto" && transport != "shm" && transport != "shm+uring") {
    bad(fmt::format("WEFT_TRANSPORT='{}' is not a transport (valid: tcp, uring, auto, shm, shm+uring)", transport));
  }
  // Read lazily by the shm collectives, where nothing may throw: refused here, at the group's creation.
  if (const char* v = env("WEFT_INLINE_SPIN_US"); v && *v) (void)detail::parse_microseconds("WEFT_INLINE_SPIN_US", v);
  // Read lazily too (host::local_ranks, the device windows' choice); "yes" was off and "four" was 1.
  if (const char* v = env("WEFT_LOCAL_WORLD_SIZE"); v && *v) (void)detail::parse_count("WEFT_LOCAL_WORLD_SIZE", v, 1, 1 << 24);
  if (const char* v = env("WEFT_SHM_CMA_BYTES"); v && *v && std::string_view(v) != "off") {
    (void)detail::parse_count("WEFT_SHM_CMA_BYTES", v, 0, 1ll << 47, "off");  // was a warning, then "off"
  }
  if (const char* v = env("WEFT_SHM_ARENA_CMA_BYTES"); v && *v && std::string_view(v) != "off" && std::string_view(v) != "on") {
    (void)detail::parse_count("WEFT_SHM_ARENA_CMA_BYTES", v, 1, 1ll << 47, "on, off");
  }
  if (const char* v = env("WEFT_DEVICE_IPC"); v && *v) (void)detail::parse_switch("WEFT_DEVICE_IPC", v);
  if (const char* v = env("WEFT_TIMEOUT")) timeout = detail::parse_duration("WEFT_TIMEOUT", v);
  if (const char* v = env("WEFT_HEARTBEAT")) heartbeat = detail::parse_duration("WEFT_HEARTBEAT", v);
  if (const char* v = env("WEFT_MAX_EARLY_BYTES")) {
    max_early_bytes = static_cast<std::size_t>(parse_int("WEFT_MAX_EARLY_BYTES", v, 0, 1ll << 50));
  }
  if (const char* v = env("WEFT_STAGING_COPY_BYTES")) {
    const auto bytes = parse_int("WEFT_STAGING_COPY_BYTES", v, 0, 1ll << 40);
    if (bytes != 0 && bytes < 4096) bad(fmt::format("WEFT_STAGING_COPY_BYTES={} is below 4096 (0 turns the pieces off)", bytes));
    staging_copy_bytes = static_cast<std::size_t>(bytes);
  }
  if (const char* v = env("WEFT_PIPELINE_DEPTH")) {
    pipeline_depth = static_cast<int>(parse_int("WEFT_PIPELINE_DEPTH", v, 1, 1024));
  }
  if (secret.empty()) {
    const char* text = env("WEFT_SECRET");
    const char* file = env("WEFT_SECRET_FILE");
    if (text && file) bad("WEFT_SECRET and WEFT_SECRET_FILE are both set: set one");
    if (text) secret = text;
    if (file) secret = read_secret_file(file);
  }
  if (job_id.empty()) {
    if (const char* v = env("WEFT_JOB_ID")) {
      job_id = v;
    } else if (const char* slurm = env("SLURM_JOB_ID")) {
      job_id = std::string("slurm-") + slurm;
      if (const char* step = env("SLURM_STEP_ID")) job_id += std::string(".") + step;
    } else if (const char* torch = env("TORCHELASTIC_RUN_ID")) {
      job_id = std::string("torchelastic-") + torch;
    }
  }
  if (const char* v = env("WEFT_INTEGRITY"); v && integrity == Integrity::off) {
    const std::string mode = v;
    if (mode == "crc32c") integrity = Integrity::crc32c;
    else if (mode == "hmac") integrity = Integrity::hmac;
    else if (mode != "off" && !mode.empty()) bad(fmt::format("WEFT_INTEGRITY='{}' is not a mode (valid: off, crc32c, hmac)", mode));
  }
  if (job_id.size() > 255) bad(fmt::format("the job id (WEFT_JOB_ID) has {} bytes; the limit is 255", job_id.size()));
  return *this;
}

}  // namespace weft
