// Group::create: the options checked and completed, the algorithm table built, the bootstrap run on the
// loop (Asio's coroutines, bridged), and the transport made over the connections it gave.
#include "weft/group.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <memory>

#include <asio.hpp>
#include <fmt/format.h>

#include "core/host.hpp"
#include "core/loop_executor.hpp"
#include "core/loop_users.hpp"
#include "core/log.hpp"
#include "core/signature.hpp"
#include "algorithms/registry.hpp"
#include "rendezvous/bootstrap.hpp"
#include "group/state.hpp"
#include "transports/select.hpp"

namespace weft {

namespace detail {
void DeleteOnLoop::operator()(Transport* transport) const {
  // From here on the deletion is under way: the loop's end need not shut the transport down.
  if (end_hook) remove_end_hook(*loop, end_hook);
  // The loop ends (a group's state that outlives its Loop lets the transport go from the loop's end
  // hooks, GroupState::leave_loop): now, on the loop's thread, since nothing will run a post.
  if (loop_ending(*loop)) {
    delete transport;
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + end_flush_limit;
  Loop* const on = loop;
  // The Linger is taken when the deletion runs on the loop's thread, not here: a post made while the
  // loop ends (from its end hooks, after its progress thread stopped) never runs, and destroying a
  // Linger it held in the io_context's teardown crashed (`device collectives (device windows, shm,
  // delays)`, every run). Such a post now holds plain pointers only: the transport is left, as before.
  // Once nothing is left to flush, or at the deadline, or when the loop ends: deleted, then `done`.
  const auto start = [on, transport, deadline](std::function<void()> done) {
    while_busy(*on, [transport] { return transport->control_pending(); }, deadline, std::make_shared<Loop::Linger>(on->linger()),
               [transport, done = std::move(done)](bool) {
                 delete transport;  // (its end hook was removed by DeleteOnLoop)
                 if (done) done();
               });
  };
  if (on->owns_thread() && !on->in_loop_thread()) {
    std::promise<void> finished;
    on->post([&] { start([&finished] { finished.set_value(); }); });
    finished.get_future().wait();
  } else {
    // On the loop thread we may be inside one of the transport's own callbacks: delete it later.
    on->post([start] { start({}); });
  }
}

}  // namespace detail

namespace {

using detail::GroupState;

// Awaits an asio::awaitable<void> from a weft Task: it runs on the loop's executor, and the Task resumes
// from its completion handler on the loop thread.
// The awaitable is made inside await_suspend: an asio::awaitable held in a co_await temporary does not
// survive g++ 12's handling of such temporaries, which may destroy one twice; so the awaiter holds only
// what is trivially destroyed (an executor member lost a strand's reference per co_await: a borrowed
// loop's strand was freed while in use).
template <class MakeAwaitable>
struct AwaitAsio {
  Loop* loop;
  MakeAwaitable make;
  std::exception_ptr error{};
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) {
    asio::co_spawn(detail::executor_of(*loop), make(), [this, h](std::exception_ptr e) {
      error = e;
      h.resume();
    });
  }
  void await_resume() const {
    if (error) std::rethrow_exception(error);
  }
};

// The default bound on early messages: generous (a legitimate program may send a message of several GiB
// before its receive is posted; a test sends one over 4 GiB), yet below what would exhaust the machine:
// half its memory, shared among the ranks the launcher put on this host (4 ranks each allowed half
// could hold twice the memory), and at least 1 GiB.
std::size_t share_of_half_the_memory() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return std::size_t{4} << 30;
  const std::size_t half = static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) / 2;
  return std::max(std::size_t{1} << 30, half / static_cast<std::size_t>(host::local_ranks()));
}

// What decides the messages a collective's plan sends, as one number that every rank's must equal (the
// greeting's details carry it): the algorithm selection, the segment size that cuts a step's data, and
// deterministic reductions (which exchange blocks instead). 0 when all three are the defaults.
std::uint64_t plans_digest(const Options& options, const algo::Selection& selection) {
  const bool defaults = selection.digest() == 0 && options.segment_bytes == Options{}.segment_bytes && !options.deterministic;
  if (defaults) return 0;
  std::uint64_t h = selection.digest();
  for (std::uint64_t v : {std::uint64_t{options.segment_bytes}, std::uint64_t{options.deterministic}}) {
    h = (h ^ v) * 0x9e3779b97f4a7c15ull;
    h ^= h >> 29;
  }
  return h == 0 ? 1 : h;
}

// How signatures name their plans (OpSignature::plan: the algorithm's family + 1, GroupState::note_planned).
std::string_view plan_name(Collective collective, std::uint8_t plan) noexcept {
  const algo::Algorithm* found = plan == 0 ? nullptr : algo::find_kind(collective, static_cast<algo::Kind>(plan - 1));
  return found ? found->name : std::string_view();
}

Task<Group> create_task(Loop* loop, Options options, algo::Selection selection) {
  signature::set_plan_namer(&plan_name);
  co_await loop->schedule();
  BootstrapResult result;
  try {
    const std::uint64_t digest = plans_digest(options, selection);
    auto run_bootstrap = [loop, &options, &result, digest] { return bootstrap(detail::executor_of(*loop), options, result, digest); };
    co_await AwaitAsio<decltype(run_bootstrap)>{loop, run_bootstrap};
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(Errc::connection_failed, ErrorContext{.rank = options.rank, .op = "bootstrap"}, e.what());
  }
  auto g = std::make_shared<GroupState>();
  g->selection = std::move(selection);
  g->watch_loop_end(loop);
  g->rank = options.rank;
  g->set_size(options.world_size);
  g->options = options;
  g->store_server = std::move(result.store_server);
  for (auto& socket : result.sockets) {
    if (socket.is_open()) FramedTransport::set_heartbeat(socket, options.heartbeat);
  }
  // The link offers, and shared memory with the peers on this host where both ranks want it.
  transports::LocalLinks links;
  try {
    auto run_links = [&]() -> asio::awaitable<void> {
      co_await transports::link_local(*loop, result.sockets, options.rank, options.transport,
                                      std::chrono::steady_clock::now() + options.bootstrap_timeout, links);
    };
    co_await AwaitAsio<decltype(run_links)>{loop, run_links};
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(Errc::connection_failed, ErrorContext{.rank = options.rank, .op = "bootstrap"}, e.what());
  }
  g->arena = links.arena;
  g->on_my_host = links.same_host;
  auto* transport = transports::create(*loop, options.rank, options.world_size, options.transport, std::move(result.sockets),
                                       std::move(links));
  transport->seal_frames(options.integrity, result.frame_keys);
  transport->set_early_limit(options.max_early_bytes ? options.max_early_bytes : share_of_half_the_memory());
  transport->watch_liveness(options.heartbeat);
  const std::uint64_t end_hook = detail::add_end_hook(
      *loop, [transport] { transport->shutdown(); }, [transport] { return transport->control_pending(); });
  g->transport = std::shared_ptr<Transport>(transport, detail::DeleteOnLoop{loop, end_hook});
  for (int i = 0; i < g->size; ++i) g->members.push_back(i);
  g->place();
  g->transport->open_context(g->context, g->members);
  log().info("rank {} of {}: group ready over {}{}", g->rank, g->size, g->transport->name(),
             options.integrity == Integrity::off ? "" : fmt::format(", frames sealed with {}", to_string(options.integrity)));
  co_return Group(std::move(g));
}

// A tuning file's choices as one WEFT_ALGO spec: its lines joined, blank lines and comments left out.
// Errors: weft::Error (invalid_argument) naming the file and why it cannot be read (a directory opened
// and read as an empty file: it was taken as a file without choices).
std::string tuning_file_choices(const Options& options) {
  const auto refuse = [&](const std::string& why) {
    throw Error(Errc::invalid_argument, ErrorContext{.rank = options.rank, .op = "configuration"},
                fmt::format("cannot read the tuning file '{}' (WEFT_TUNING, Options::tuning_file): {}", options.tuning_file, why));
  };
  std::error_code error;
  if (std::filesystem::is_directory(options.tuning_file, error)) refuse("it is a directory");
  errno = 0;
  std::ifstream file(options.tuning_file);
  if (!file) refuse(errno ? std::strerror(errno) : "it cannot be opened");
  std::string content;
  for (std::string line; std::getline(file, line);) {
    if (line.empty() || line[0] == '#') continue;
    content += line + ";";
  }
  if (file.bad()) refuse("reading it failed");
  return content;
}

}  // namespace

Future<Group> Group::create(Loop& loop) { return create(loop, Options{}); }

Future<Group> Group::create(Loop& loop, const Options& given) {
  Options options = given;
  options.from_environment();
  for (const auto& [name, value] : {std::pair{"timeout", options.timeout}, std::pair{"heartbeat", options.heartbeat},
                                    std::pair{"bootstrap_timeout", options.bootstrap_timeout}}) {
    if (value.count() < 0 || value > max_duration) {
      throw Error(Errc::invalid_argument, ErrorContext{.rank = options.rank, .op = "configuration"},
                  fmt::format("Options::{} is {} ms: it must be 0 to {} ms (a year; 0: none)", name, value.count(),
                              max_duration.count()));
    }
  }
  // Heartbeats are the kernel's keepalive probes, whose interval it takes in whole seconds; and data
  // unacknowledged for 4 intervals fails the connection, so an interval far below the kernel's delayed
  // acknowledgement (40-200 ms) and its shortest retransmission timeout (200 ms) would call a live peer
  // dead (1 ms did, at the group's first collective).
  if (options.heartbeat.count() > 0 && options.heartbeat < std::chrono::seconds(1)) {
    throw Error(Errc::invalid_argument, ErrorContext{.rank = options.rank, .op = "configuration"},
                fmt::format("Options::heartbeat (WEFT_HEARTBEAT) is {} ms: it must be 0 (off) or at least 1 s (the kernel's "
                            "keepalive counts whole seconds, and a shorter limit would call a live peer dead on a delayed "
                            "acknowledgement)", options.heartbeat.count()));
  }
  if (options.integrity == Integrity::hmac && options.secret.empty()) {
    throw Error(Errc::invalid_argument, ErrorContext{.rank = options.rank, .op = "configuration"},
                "WEFT_INTEGRITY=hmac (Options::integrity) needs a shared secret to key its MACs: set WEFT_SECRET or "
                "WEFT_SECRET_FILE on every rank (or use crc32c, which needs none)");
  }
  // Algorithm choices: the built-in table, then a tuning file, then WEFT_ALGO. Malformed ones fail here.
  algo::Selection selection;
  if (!options.tuning_file.empty()) selection.override_with(tuning_file_choices(options), "the tuning file " + options.tuning_file);
  selection.override_with(options.algorithms, "WEFT_ALGO");
  return spawn(loop, create_task(&loop, std::move(options), std::move(selection)));
}

}  // namespace weft
