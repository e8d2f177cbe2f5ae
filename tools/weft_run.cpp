// weft-run: starts N local ranks of a program with weft's environment set, prefixes every output line with
// its rank, and when one rank fails (non-zero exit or a signal) ends the others and fails, naming it.
//
//   weft-run -n N [--host ADDR] [--port P] [--timeout SECONDS] [--bind core|none] [--] PROGRAM [ARGS...]
#include <fcntl.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

namespace {

volatile sig_atomic_t interrupted = 0;

void on_signal(int sig) { interrupted = sig; }

// `bytes` random bytes as hex (getrandom: the kernel's CSPRNG).
std::string random_hex(std::size_t bytes) {
  std::vector<unsigned char> raw(bytes);
  std::size_t got = 0;
  while (got < bytes) {
    const auto n = getrandom(raw.data() + got, bytes - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      fmt::print(stderr, "weft-run: getrandom: {}\n", std::strerror(errno));
      std::exit(2);
    }
    got += static_cast<std::size_t>(n);
  }
  std::string out;
  for (unsigned char c : raw) out += fmt::format("{:02x}", c);
  return out;
}

[[noreturn]] void usage(const std::string& problem) {
  if (!problem.empty()) fmt::print(stderr, "weft-run: {}\n", problem);
  fmt::print(stderr,
             "usage: weft-run -n N [--host ADDR] [--port P] [--timeout SECONDS] [--bind core|none] [--] PROGRAM [ARGS...]\n"
             "  Starts N ranks of PROGRAM with WEFT_RANK, WEFT_WORLD_SIZE, WEFT_LOCAL_RANK and WEFT_STORE set, and, unless\n"
             "  already set, a fresh WEFT_JOB_ID and a fresh random WEFT_SECRET for this launch (so its ranks\n"
             "  authenticate each other and no other process can join them), and WEFT_TRANSPORT=shm unless set (its\n"
             "  ranks share this host: shared memory and the direct shm collectives).\n"
             "  --host ADDR      address of the store rank 0 serves (default 127.0.0.1)\n"
             "  --port P         its port (default: a free one)\n"
             "  --timeout S      end every rank and fail after S seconds (default: none)\n"
             "  --bind core|none pin rank r to the r-th allowed CPU (default: core when N <= CPUs, as mpirun does)\n");
  std::exit(2);
}

int parse_int(const char* flag, const char* text) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  if (errno || !end || *end || v < 0 || v > 1'000'000) usage(fmt::format("{} expects a non-negative integer, got '{}'", flag, text));
  return static_cast<int>(v);
}

unsigned short free_port(const std::string& host) {
  const bool v6 = host.find(':') != std::string::npos;
  const int fd = ::socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM, 0);
  // Port 0 on `host`: the kernel picks a free port, which getsockname reports (in the same place for both
  // families: sin_port and sin6_port share their offset).
  sockaddr_storage a{};
  socklen_t len = v6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  a.ss_family = v6 ? AF_INET6 : AF_INET;
  void* address = v6 ? static_cast<void*>(&reinterpret_cast<sockaddr_in6*>(&a)->sin6_addr) : &reinterpret_cast<sockaddr_in*>(&a)->sin_addr;
  inet_pton(a.ss_family, host.c_str(), address);
  unsigned short port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), len) == 0 && ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(v6 ? reinterpret_cast<sockaddr_in6*>(&a)->sin6_port : reinterpret_cast<sockaddr_in*>(&a)->sin_port);
  }
  ::close(fd);
  if (port == 0) {
    fmt::print(stderr, "weft-run: cannot find a free port on {}\n", host);
    std::exit(2);
  }
  return port;
}

struct Rank {
  pid_t pid = -1;
  int out_fd = -1;
  int err_fd = -1;
  std::string out_partial;
  std::string err_partial;
  bool running = false;
  int status = 0;
};

// Writes every complete line of `chunk` with the rank prefix; keeps the unfinished tail for later.
void emit(int rank, std::string& partial, const char* chunk, std::size_t n, FILE* to, bool flush_all) {
  partial.append(chunk, n);
  std::size_t start = 0;
  for (;;) {
    const auto nl = partial.find('\n', start);
    if (nl == std::string::npos) break;
    fmt::print(to, "[{}] {}\n", rank, std::string_view(partial).substr(start, nl - start));
    start = nl + 1;
  }
  partial.erase(0, start);
  if (flush_all && !partial.empty()) {
    fmt::print(to, "[{}] {}\n", rank, partial);
    partial.clear();
  }
  std::fflush(to);
}

std::string describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return "ended";
}

// What the command line asks for.
struct Launch {
  int ranks = -1;
  int port = -1;
  int timeout_s = 0;
  std::string host = "127.0.0.1";
  std::string bind = "auto";
  char** program = nullptr;  // PROGRAM ARGS..., null-terminated (argv's tail)
};

Launch parse(int argc, char** argv) {
  Launch launch;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "-n" || a == "--np" || a == "-np") launch.ranks = parse_int("-n", value());
    else if (a == "--port") {
      launch.port = parse_int("--port", value());
      if (launch.port > 65535) usage(fmt::format("--port expects a TCP port (0-65535), got {}", launch.port));
    }
    else if (a == "--host") launch.host = value();
    else if (a == "--timeout") launch.timeout_s = parse_int("--timeout", value());
    else if (a == "--bind") {
      launch.bind = value();
      if (launch.bind != "core" && launch.bind != "none") usage("--bind takes core or none");
    }
    else if (a == "-h" || a == "--help") usage("");
    else if (a == "--") {
      ++i;
      break;
    } else if (!a.empty() && a[0] == '-') usage("unknown option " + a);
    else break;
  }
  if (launch.ranks < 1) usage("-n N (N >= 1) is required");
  if (i >= argc) usage("no program to run");
  if (launch.port < 0) launch.port = free_port(launch.host);
  launch.program = argv + i;
  return launch;
}

// CPUs this launcher may use; with one rank per CPU, a rank's threads stay on its core and never share
// one with a peer they wait for (two polling ranks on one core take turns in whole time slices).
std::vector<int> cpus_to_pin(const Launch& launch) {
  std::vector<int> cpus;
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
    }
  }
  const bool pin = launch.bind == "core" || (launch.bind == "auto" && !cpus.empty() && launch.ranks <= static_cast<int>(cpus.size()));
  return pin ? cpus : std::vector<int>{};
}

// The build tree's Python package root (<build>/python, beside <build>/tools/weft-run), where it holds
// the weft module: so that `weft-run -n 4 -- python3 script.py` imports the weft it was built with.
// Empty for an installed weft-run (the module is in Python's site-packages there).
std::string python_package_root() {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return {};
  std::string dir(self, static_cast<std::size_t>(n));
  dir = dir.substr(0, dir.rfind('/'));               // <build>/tools
  const std::string root = dir.substr(0, dir.rfind('/')) + "/python";
  return access((root + "/weft/__init__.py").c_str(), R_OK) == 0 ? root : std::string();
}

// Starts every rank with weft's environment, its output on pipes. Exits 2 when a rank cannot be started.
std::vector<Rank> start_ranks(const Launch& launch) {
  const std::string python_root = python_package_root();
  // One job id and one secret per launch, unless the caller chose them.
  const std::string job_id = std::getenv("WEFT_JOB_ID") ? std::string() : "weft-run-" + random_hex(8);
  const std::string secret = std::getenv("WEFT_SECRET") || std::getenv("WEFT_SECRET_FILE") ? std::string() : random_hex(32);
  const std::string store = launch.host.find(':') != std::string::npos ? fmt::format("[{}]:{}", launch.host, launch.port)
                                                                       : fmt::format("{}:{}", launch.host, launch.port);
  const std::vector<int> cpus = cpus_to_pin(launch);
  const int n = launch.ranks;
  // Every rank's output takes two pipes held open here: more ranks than the descriptor limit allows
  // would fail part way, after some had started (`pipe: Too many open files` at -n 100000). Said before
  // any is started, with what to raise.
  rlimit files{};
  const long long needed = 2LL * n + 32;  // the two read ends per rank, and stdio, the store's socket, slack
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY && static_cast<long long>(files.rlim_cur) < needed) {
    fmt::print(stderr, "weft-run: {} ranks need about {} open files here, and the limit is {} (raise it with ulimit -n)\n", n, needed,
               static_cast<long long>(files.rlim_cur));
    std::exit(2);
  }
  std::vector<Rank> ranks(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    int out[2];
    int err[2];
    if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) {
      fmt::print(stderr, "weft-run: pipe: {}\n", std::strerror(errno));
      std::exit(2);
    }
    const pid_t pid = fork();
    if (pid < 0) {
      fmt::print(stderr, "weft-run: fork: {}\n", std::strerror(errno));
      std::exit(2);
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // a rank never outlives its launcher
      if (!cpus.empty()) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpus[static_cast<std::size_t>(r) % cpus.size()], &one);
        sched_setaffinity(0, sizeof one, &one);
      }
      dup2(out[1], STDOUT_FILENO);
      dup2(err[1], STDERR_FILENO);
      setenv("WEFT_RANK", std::to_string(r).c_str(), 1);
      setenv("WEFT_WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("WEFT_LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WEFT_LOCAL_WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("WEFT_STORE", store.c_str(), 1);
      // Every rank of this launcher shares this host: shared memory, unless the user chose otherwise.
      setenv("WEFT_TRANSPORT", "shm", 0);
      if (!job_id.empty()) setenv("WEFT_JOB_ID", job_id.c_str(), 1);
      if (!secret.empty()) setenv("WEFT_SECRET", secret.c_str(), 1);
      if (!python_root.empty()) {
        const char* path = std::getenv("PYTHONPATH");
        setenv("PYTHONPATH", (path && *path ? python_root + ":" + path : python_root).c_str(), 1);
      }
      execvp(launch.program[0], launch.program);
      fmt::print(stderr, "weft-run: cannot run {}: {}\n", launch.program[0], std::strerror(errno));
      _exit(127);
    }
    close(out[1]);
    close(err[1]);
    auto& rank = ranks[static_cast<std::size_t>(r)];
    rank.pid = pid;
    rank.out_fd = out[0];
    rank.err_fd = err[0];
    rank.running = true;
  }
  return ranks;
}

// Moves every rank's output to ours (one poll, up to 50 ms), line by line with its rank prefix.
void forward_output(std::vector<Rank>& ranks) {
  std::vector<pollfd> fds;
  std::vector<std::pair<int, bool>> owners;  // (rank, is_stderr)
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r) {
    auto& rank = ranks[static_cast<std::size_t>(r)];
    if (rank.out_fd >= 0) {
      fds.push_back({rank.out_fd, POLLIN, 0});
      owners.emplace_back(r, false);
    }
    if (rank.err_fd >= 0) {
      fds.push_back({rank.err_fd, POLLIN, 0});
      owners.emplace_back(r, true);
    }
  }
  if (fds.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    return;
  }
  poll(fds.data(), fds.size(), 50);
  for (std::size_t k = 0; k < fds.size(); ++k) {
    if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    auto [r, is_err] = owners[k];
    auto& rank = ranks[static_cast<std::size_t>(r)];
    char buffer[65536];
    const ssize_t got = read(fds[k].fd, buffer, sizeof buffer);
    if (got > 0) {
      emit(r, is_err ? rank.err_partial : rank.out_partial, buffer, static_cast<std::size_t>(got), is_err ? stderr : stdout, false);
    } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
      emit(r, is_err ? rank.err_partial : rank.out_partial, "", 0, is_err ? stderr : stdout, true);
      close(fds[k].fd);
      (is_err ? rank.err_fd : rank.out_fd) = -1;
    }
  }
}

// Forwards output and reaps the ranks until all are gone. The first rank that fails (non-zero exit, a
// signal), an interrupt or the timeout ends the others: SIGTERM, then SIGKILL 3 s later. Returns the exit
// status weft-run ends with: the failed rank's (128 + signal for a signal), 128 + the signal that interrupted
// weft-run (130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP), 124 timed out.
int reap(std::vector<Rank>& ranks, const Launch& launch) {
  const auto started = std::chrono::steady_clock::now();
  int failed_rank = -1;
  int failed_status = 0;
  bool timed_out = false;
  bool ending = false;
  std::chrono::steady_clock::time_point kill_at{};
  auto running = [&] {
    return std::any_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.running; });
  };
  auto end_all = [&](int sig) {
    for (auto& r : ranks) {
      if (r.running) kill(r.pid, sig);
    }
  };
  auto begin_ending = [&](const std::string& why) {
    fmt::print(stderr, "weft-run: {}\n", why);
    ending = true;
    end_all(SIGTERM);
    kill_at = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  };

  for (;;) {
    const bool any_output = std::any_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.out_fd >= 0 || r.err_fd >= 0; });
    if (!any_output && !running()) break;
    forward_output(ranks);

    for (int r = 0; r < static_cast<int>(ranks.size()); ++r) {
      auto& rank = ranks[static_cast<std::size_t>(r)];
      if (!rank.running) continue;
      int status = 0;
      if (waitpid(rank.pid, &status, WNOHANG) == rank.pid) {
        rank.running = false;
        rank.status = status;
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && failed_rank < 0 && !ending) {
          failed_rank = r;
          failed_status = status;
          begin_ending(fmt::format("rank {} {}; ending the other ranks", r, describe(status)));
        }
      }
    }
    if (interrupted && !ending) {
      begin_ending(fmt::format("interrupted (signal {}); ending every rank", static_cast<int>(interrupted)));
    }
    if (launch.timeout_s > 0 && !ending && std::chrono::steady_clock::now() - started > std::chrono::seconds(launch.timeout_s)) {
      timed_out = true;
      begin_ending(fmt::format("timed out after {} s; ending every rank", launch.timeout_s));
    }
    if (ending && std::chrono::steady_clock::now() > kill_at) {
      end_all(SIGKILL);
      // Stragglers' pipes may be held open by their own children: stop reading once every rank is gone.
      if (!running()) break;
    }
  }

  if (failed_rank >= 0) {
    fmt::print(stderr, "weft-run: failed: rank {} {}\n", failed_rank, describe(failed_status));
    if (WIFEXITED(failed_status)) return WEXITSTATUS(failed_status);
    return 128 + WTERMSIG(failed_status);
  }
  if (interrupted) return 128 + static_cast<int>(interrupted);
  if (timed_out) return 124;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Launch launch = parse(argc, argv);
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  // A closed terminal (or an ssh session that dropped) ends the ranks as an interrupt does: SIGTERM first,
  // so that they can say goodbye; only dying here would leave them to PR_SET_PDEATHSIG's SIGKILL.
  sigaction(SIGHUP, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
  std::vector<Rank> ranks = start_ranks(launch);
  return reap(ranks, launch);
}
