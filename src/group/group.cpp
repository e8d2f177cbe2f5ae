#include "weft/group.hpp"

#include <unistd.h>

#include <algorithm>
#include <stdexcept>
#include <atomic>
#include <cstring>
#include <fstream>
#include <future>
#include <mutex>

#include <asio.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "src/algorithms/reduction.hpp"
#include "src/algorithms/selection.hpp"
#include "src/core/log.hpp"
#include "src/core/host.hpp"
#include "src/core/signature.hpp"
#include "src/group/bootstrap.hpp"
#include "transports/select.hpp"

namespace weft {

namespace algo = algorithms;

namespace detail {

// One buffer collective as the public methods pack it, as NCCL packs every call into one ncclInfo: all
// that validation, selection and the task need.
struct CollectiveCall {
  Collective collective;
  ConstBufferView in;
  BufferView out;
  ReduceOp op = ReduceOp::sum;
  int root = -1;
};

}  // namespace detail

namespace detail {

// Deletes a transport on its loop's thread, where its handlers run; from another thread of an owned loop
// it waits for that, so that nothing of the transport outlives the Group's destruction.
struct DeleteOnLoop {
  Loop* loop;
  void operator()(Transport* transport) const {
    if (loop->owns_thread() && !loop->in_loop_thread()) {
      std::promise<void> done;
      loop->post([&] {
        delete transport;
        done.set_value();
      });
      done.get_future().wait();
    } else {
      // On the loop thread we may be inside one of the transport's own callbacks: delete it later.
      loop->post([transport] { delete transport; });
    }
  }
};

struct GroupState : std::enable_shared_from_this<GroupState> {
  Loop* loop = nullptr;
  std::shared_ptr<Transport> transport;            // shared with the groups split from this one
  std::shared_ptr<store::Server> store_server;     // rank 0 of the world group only
  std::uint32_t context = 1;
  int rank = 0;
  int size = 1;
  std::vector<int> members;                        // group rank -> transport rank
  Options options;
  algo::Selection selection;                       // which algorithm runs what; read by callers
  std::atomic<std::uint64_t> next_seq{1};          // written by callers, in program order
  std::atomic<bool> failed{false};                 // set on the loop thread, read by callers
  std::atomic<std::uint64_t> shrinks{0};           // shrink() calls so far: each gets its own exchange
  std::mutex failure_mutex;
  std::string failure;                             // guarded by failure_mutex

  ~GroupState() {
    if (!transport) return;
    // A weak reference: the last Group's transport is deleted now (DeleteOnLoop), not by this lambda
    // after the Loop may have stopped.
    loop->post([weak = std::weak_ptr<Transport>(transport), context = context] {
      if (auto t = weak.lock()) t->close_context(context);
    });
  }

  ErrorContext where(const char* op, std::int64_t seq, int peer = -1, std::int64_t tag = -1) const {
    return ErrorContext{rank, peer, op, seq, tag};
  }

  void mark_failed(const std::string& what) {
    std::lock_guard lock(failure_mutex);
    if (failed.exchange(true)) return;
    failure = what;
  }

  /// What the caller asked for, beyond the buffers: the element count every rank passes and the root.
  /// With the name, dtype and reduce op it makes the operation's signature (mismatch detection).
  struct Call {
    std::uint64_t count = 0;
    int root = -1;
  };

  algo::Channel channel(std::uint64_t seq, const char* op, const OpSignature& signature, std::uint64_t first_tag) const {
    algo::Channel ch{loop, transport.get(), context, seq, rank, members, op, first_tag};
    ch.signature = signature;
    return ch;
  }

  algo::ExecOptions exec_options() const { return algo::ExecOptions{options.segment_bytes, options.pipeline_depth}; }

  /// Runs one collective's plan; a failure fails the group (its peers are told by the abort frame).
  Task<void> run(const algo::Plan& plan, std::uint64_t seq, Collective collective, algo::PlanBuffers buffers, Call call,
                 std::uint64_t first_tag = 0) {
    return run_signed(plan, seq, to_string(collective).data(),
                      signature::of(collective, buffers.dtype, buffers.op, call.count, call.root), buffers, first_tag);
  }
  /// The same for a plan of the user's (`op` names it in errors).
  Task<void> run_signed(const algo::Plan& plan, std::uint64_t seq, const char* op, OpSignature signature,
                        algo::PlanBuffers buffers, std::uint64_t first_tag = 0) {
    watch(seq, op);
    try {
      co_await algo::execute(channel(seq, op, signature, first_tag), plan, buffers, exec_options());
    } catch (const Error& e) {
      unwatch(seq);
      // A cancelled operation was cancelled on every member (a cancel frame): the group goes on.
      if (e.errc() != Errc::cancelled) mark_failed(e.what());
      throw;
    }
    unwatch(seq);
  }

  // Deadlines. A timer per operation cost 2600 instructions per 1 KiB all_reduce (+19%, bench/RESULTS.md);
  // instead the running operations are listed with their start, and one watchdog timer per group, armed
  // while any runs, looks every min(timeout / 4, 250 ms). Loop thread only.
  struct Watched {
    std::uint64_t id;  // the operation's seq; point-to-point operations get ids from p2p_ids
    std::chrono::steady_clock::time_point started;
    std::chrono::milliseconds timeout;
    std::function<void()> expire;  // small captures only: no allocation per operation
  };
  std::vector<Watched> watched;
  bool watchdog_armed = false;
  std::uint64_t p2p_ids = std::uint64_t{1} << 63;

  // Deadlines of single operations (Group::with_timeout), by seq: written by callers, read on the loop.
  // A fixed ring of the latest: a deadline is looked up when its operation starts, soon after the call.
  std::atomic<bool> any_deadline_set{false};
  std::mutex deadlines_mutex;
  std::array<std::pair<std::uint64_t, std::chrono::milliseconds>, 64> deadlines{};
  std::size_t deadlines_pushed = 0;

  void set_deadline(std::uint64_t seq, std::chrono::milliseconds timeout) {
    std::lock_guard lock(deadlines_mutex);
    deadlines[deadlines_pushed++ % deadlines.size()] = {seq, timeout};
    any_deadline_set.store(true, std::memory_order_release);
  }

  std::chrono::milliseconds deadline_of(std::uint64_t seq) {
    if (any_deadline_set.load(std::memory_order_acquire)) {
      std::lock_guard lock(deadlines_mutex);
      for (const auto& [s, t] : deadlines) {
        if (s == seq) return t;
      }
    }
    return options.timeout;
  }

  void watch(std::uint64_t seq, const char* op) {
    const auto timeout = deadline_of(seq);
    if (timeout.count() <= 0) return;
    watch(Watched{seq, std::chrono::steady_clock::now(), timeout, [this, seq, op, timeout] { time_out(seq, op, timeout); }});
  }

  void watch(Watched w) {
    watched.push_back(std::move(w));
    if (!watchdog_armed) arm_watchdog();
  }

  void arm_watchdog() {
    watchdog_armed = true;
    auto shortest = options.timeout.count() > 0 ? options.timeout : std::chrono::milliseconds(1000);
    for (const Watched& w : watched) shortest = std::min(shortest, w.timeout);
    const auto period = std::min<std::chrono::milliseconds>(shortest / 4, std::chrono::milliseconds(250));
    loop->call_after(std::max(period, std::chrono::milliseconds(1)), [weak = weak_from_this()](bool) {
      if (auto self = weak.lock()) self->on_watchdog();
    });
  }

  void unwatch(std::uint64_t id) {
    for (auto it = watched.rbegin(); it != watched.rend(); ++it) {
      if (it->id == id) {
        watched.erase(std::next(it).base());
        return;
      }
    }
  }

  void on_watchdog() {
    watchdog_armed = false;
    const auto now = std::chrono::steady_clock::now();
    std::vector<std::function<void()>> late;
    for (const Watched& w : watched) {
      if (now - w.started >= w.timeout) late.push_back(w.expire);
    }
    // Expiring completes operations, whose coroutines then unwatch: work on the copy.
    for (const auto& expire : late) expire();
    if (!watched.empty() && !watchdog_armed) arm_watchdog();
  }

  static std::string duration_text(std::chrono::milliseconds t) {
    const auto ms = t.count();
    return ms % 1000 == 0 ? fmt::format("{} s", ms / 1000) : fmt::format("{} ms", ms);
  }

  // A deadline passed: before failing, ask every member how far it is (a progress query, answered by
  // its transport's loop), so that the report names the ranks that had not joined the operation, not only
  // the neighbours this rank waits on (in a ring, most ranks wait on a rank that waits on the late one).
  std::vector<std::uint64_t> reporting;  // operations whose query is out

  void time_out(std::uint64_t seq, const char* op, std::chrono::milliseconds timeout) {
    if (std::find(reporting.begin(), reporting.end(), seq) != reporting.end()) return;
    reporting.push_back(seq);
    std::vector<std::string> names;
    for (int peer : transport->waiting_on(context, seq)) names.push_back(std::to_string(group_rank(peer)));
    const std::string after = duration_text(timeout);
    const std::string whom = names.empty() ? std::string("no peer (the operation had not reached the network)")
                                           : fmt::format("rank{} {}", names.size() > 1 ? "s" : "", fmt::join(names, ", "));
    const auto patience = std::clamp<std::chrono::milliseconds>(timeout / 4, std::chrono::milliseconds(50),
                                                                std::chrono::milliseconds(500));
    const std::string head = fmt::format("{} #{} passed its deadline ({}) on rank {}, still waiting for {}", op, seq, after, rank, whom);
    transport->ask_progress(context, seq, patience, [weak = weak_from_this(), seq, head, patience](std::vector<Transport::Progress> answers) {
      auto self = weak.lock();
      if (!self) return;
      std::erase(self->reporting, seq);
      const bool still_running = std::any_of(self->watched.begin(), self->watched.end(), [&](const Watched& w) { return w.id == seq; });
      if (!still_running) return;  // it completed while the members were asked
      // A member that called the operation differently: a mismatch that sent no frame to anyone (a
      // reduce whose ranks disagree on the root can wait on each other in silence). Say so, not "late".
      if (const std::string calls = self->mismatched_calls(seq, answers); !calls.empty()) {
        self->transport->abort_context(self->context, Errc::mismatch, head + "; the ranks called it differently: " + calls);
        return;
      }
      self->transport->abort_context(self->context, Errc::timeout, head + "; " + self->stragglers(seq, answers, patience));
    });
  }

  // "rank 2 called reduce #1 (f32 x 8, sum, root 2) while rank 0 called reduce #1 (f32 x 8, sum, root 0)",
  // or empty when every member that answered called operation `seq` as this rank did (or not yet).
  std::string mismatched_calls(std::uint64_t seq, const std::vector<Transport::Progress>& answers) const {
    const OpSignature mine = transport->signature_of(context, seq);
    if (mine.call == 0) return {};
    std::vector<std::string> others;
    for (const auto& a : answers) {
      if (!a.answered || a.signature.call == 0 || a.signature == mine) continue;
      others.push_back(fmt::format("rank {} called {}", group_rank(a.rank), signature::describe(a.signature, seq)));
    }
    if (others.empty()) return {};
    return fmt::format("{} while rank {} called {}", fmt::join(others, ", "), rank, signature::describe(mine, seq));
  }

  int group_rank(int transport_rank) const {
    const auto it = std::find(members.begin(), members.end(), transport_rank);
    return it == members.end() ? -1 : static_cast<int>(it - members.begin());
  }

  // "not joined: rank 3 (no answer within 125 ms: stopped, hung, or busy outside weft), rank 2 (latest #4)".
  std::string stragglers(std::uint64_t seq, const std::vector<Transport::Progress>& answers, std::chrono::milliseconds patience) const {
    std::vector<std::string> late;
    for (const auto& a : answers) {
      const int who = group_rank(a.rank);
      if (!a.answered) {
        late.push_back(fmt::format("rank {} (no answer within {} ms: stopped, hung, or busy outside weft)", who, patience.count()));
      } else if (a.started < seq) {
        late.push_back(a.started == 0 ? fmt::format("rank {} (it had started no collective)", who)
                                      : fmt::format("rank {} (its latest is #{})", who, a.started));
      }
    }
    if (late.empty()) return "every rank had joined it";
    return fmt::format("not joined: {}", fmt::join(late, ", "));
  }
};

}  // namespace detail

namespace {

using detail::GroupState;

// ---------------------------------------------------------------- preconditions

[[noreturn]] void invalid(const GroupState& g, const char* op, const std::string& detail, int peer = -1) {
  throw Error(Errc::invalid_argument, g.where(op, static_cast<std::int64_t>(g.next_seq.load()), peer), detail);
}

void check_usable(GroupState& g, const char* op) {
  if (g.failed.load()) {
    std::lock_guard lock(g.failure_mutex);
    throw Error(Errc::group_failed, g.where(op, static_cast<std::int64_t>(g.next_seq.load())),
                fmt::format("an earlier operation failed: {}", g.failure));
  }
}

void check_host(const GroupState& g, const char* op, Device device) {
  if (device.kind != Device::Kind::host) invalid(g, op, "device buffers are not supported by this group's transport");
}

// The most bytes a buffer can have: 128 TiB, the user address space of x86-64 and aarch64 (48-bit).
// A count beyond it is a bug (or an attack) whose byte count would wrap or drive allocations.
constexpr std::size_t max_buffer_bytes = std::size_t{1} << 47;

void check_buffer(const GroupState& g, const char* op, const char* name, const void* data, std::size_t count,
                  DType dtype, Device device) {
  check_host(g, op, device);
  if (count > max_buffer_bytes / dtype_size(dtype)) {
    invalid(g, op, fmt::format("{} claims {} elements of {} ({} bytes each): more than memory can hold (at most 2^47 "
                               "bytes per buffer)", name, count, to_string(dtype), dtype_size(dtype)));
  }
  if (count > 0 && data == nullptr) invalid(g, op, fmt::format("{} is null with {} elements", name, count));
}

// count x the group's size, for collectives whose buffer holds a block per rank; refused past what a
// buffer can hold rather than wrapped.
std::size_t per_rank_total(const GroupState& g, const char* op, std::size_t count) {
  const auto p = static_cast<std::size_t>(g.size);
  if (count > max_buffer_bytes / p) {
    invalid(g, op, fmt::format("{} elements per rank x {} ranks is more than a buffer can hold", count, p));
  }
  return count * p;
}

void check_same_type(const GroupState& g, const char* op, DType a, DType b) {
  if (a != b) invalid(g, op, fmt::format("input is {} but output is {}", to_string(a), to_string(b)));
}

void check_count(const GroupState& g, const char* op, const char* what, std::size_t got, std::size_t expected) {
  if (got != expected) invalid(g, op, fmt::format("{} has {} elements, expected {}", what, got, expected));
}

void check_op(const GroupState& g, const char* op, DType type, ReduceOp reduce) {
  if (!is_defined(type, reduce)) {
    invalid(g, op, fmt::format("reduce op {} is not defined on {}", to_string(reduce), to_string(type)));
  }
}

void check_rank(const GroupState& g, const char* op, const char* what, int r) {
  if (r < 0 || r >= g.size) invalid(g, op, fmt::format("{} {} is not a rank of this group of {}", what, r, g.size), r);
}

// The operation's sequence number; a view made by with_timeout() records its deadline for it.
std::uint64_t take_seq(GroupState& g, std::chrono::milliseconds timeout) {
  const std::uint64_t seq = g.next_seq.fetch_add(1);
  if (timeout.count() >= 0) g.set_deadline(seq, timeout);
  return seq;
}

void copy_bytes(void* dst, const void* src, std::size_t bytes) {
  if (bytes && dst != src) std::memmove(dst, src, bytes);
}

// Slot buffers of p blocks in rotated order (Bruck, binomial gather/scatter): slot i holds the block of
// rank (first + i) mod p, or for all_to_all's way out, of rank (first - i) mod p.
enum class Turn { up, down };
void slots_from_blocks(std::byte* slots, const std::byte* blocks, std::size_t p, std::size_t first, std::size_t block_bytes) {
  for (std::size_t i = 0; i < p; ++i) copy_bytes(slots + i * block_bytes, blocks + ((first + i) % p) * block_bytes, block_bytes);
}
void blocks_from_slots(std::byte* blocks, const std::byte* slots, std::size_t p, std::size_t first, std::size_t block_bytes,
                       Turn turn = Turn::up) {
  for (std::size_t i = 0; i < p; ++i) {
    const std::size_t owner = turn == Turn::up ? (first + i) % p : (first + p - i) % p;
    copy_bytes(blocks + owner * block_bytes, slots + i * block_bytes, block_bytes);
  }
}

std::uint32_t derive_context(std::uint32_t parent, std::uint64_t seq, int color) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::uint64_t v : {static_cast<std::uint64_t>(parent), seq, static_cast<std::uint64_t>(static_cast<std::uint32_t>(color))}) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  auto c = static_cast<std::uint32_t>(h ^ (h >> 32));
  return c < 2 ? c + 2 : c;  // 0 is unused, 1 is the world
}

// ---------------------------------------------------------------- bridging Asio's coroutines

// Awaits an asio::awaitable<void> from a weft Task: it runs on the same io_context, and the Task resumes
// from its completion handler on the loop thread.
// The awaitable is made inside await_suspend: an asio::awaitable held in a co_await temporary does not
// survive g++ 12's handling of such temporaries.
template <class MakeAwaitable>
struct AwaitAsio {
  asio::io_context& io;
  MakeAwaitable make;
  std::exception_ptr error{};
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) {
    asio::co_spawn(io, make(), [this, h](std::exception_ptr e) {
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

Task<Group> create_task(Loop* loop, Options options, algo::Selection selection) {
  co_await loop->schedule();
  BootstrapResult result;
  try {
    auto run_bootstrap = [loop, &options, &result] { return bootstrap(loop->context(), options, result); };
    co_await AwaitAsio<decltype(run_bootstrap)>{loop->context(), run_bootstrap};
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(Errc::connection_failed, ErrorContext{.rank = options.rank, .op = "bootstrap"}, e.what());
  }
  auto g = std::make_shared<GroupState>();
  g->selection = std::move(selection);
  g->loop = loop;
  g->rank = options.rank;
  g->size = options.world_size;
  g->options = options;
  g->store_server = std::move(result.store_server);
  for (auto& socket : result.sockets) {
    if (socket.is_open()) TcpTransport::set_heartbeat(socket, options.heartbeat);
  }
  auto* transport = transports::create(*loop, options.rank, options.world_size, options.transport, std::move(result.sockets));
  transport->seal_frames(options.integrity, result.frame_keys);
  transport->set_early_limit(options.max_early_bytes ? options.max_early_bytes : share_of_half_the_memory());
  transport->watch_liveness(options.heartbeat);
  g->transport = std::shared_ptr<Transport>(transport, detail::DeleteOnLoop{loop});
  for (int i = 0; i < g->size; ++i) g->members.push_back(i);
  g->transport->open_context(g->context, g->members);
  log().info("rank {} of {}: group ready over {}{}", g->rank, g->size, g->transport->name(),
             options.integrity == Integrity::off ? "" : fmt::format(", frames sealed with {}", integrity_name(options.integrity)));
  co_return Group(std::move(g));
}

// ---------------------------------------------------------------- operations

struct OpHook {
  bool finished = false;   // loop thread only
  bool timed_out = false;  // its deadline passed (the watchdog withdrew or aborted it)
  GroupState* g = nullptr;
  TransportOp* op = nullptr;
};

// A point-to-point operation's deadline: a receive still unmatched is withdrawn (the group stays usable);
// a send not written yet cannot be taken back from the receiver's view, so the group is aborted.
std::uint64_t watch_p2p(GroupState& g, const std::shared_ptr<OpHook>& hook, std::chrono::milliseconds timeout, bool is_send) {
  if (timeout.count() <= 0) return 0;
  const std::uint64_t id = g.p2p_ids++;
  std::function<void()> expire;
  if (is_send) {
    expire = [hook] {
      if (hook->finished) return;
      hook->timed_out = true;
      auto& g = *hook->g;
      g.transport->abort_context(g.context, Errc::timeout,
                                 fmt::format("a send from rank {} to rank {} [tag {}] passed its deadline: the receiver did not take it "
                                             "(a send cannot be withdrawn once started)",
                                             g.rank, g.group_rank(hook->op->peer), hook->op->key.tag));
    };
  } else {
    expire = [hook] {
      if (hook->finished) return;
      hook->timed_out = true;  // before: a withdrawn receive resumes its coroutine inside cancel_recv
      if (!hook->g->transport->cancel_recv(*hook->op)) hook->timed_out = false;  // it matched: let it finish
    };
  }
  g.watch(GroupState::Watched{id, std::chrono::steady_clock::now(), timeout, std::move(expire)});
  return id;
}

Task<void> send_task(std::shared_ptr<GroupState> g, ConstBufferView data, int dst, std::uint32_t tag, std::uint64_t op_seq,
                     std::chrono::milliseconds timeout) {
  TransportOp op;
  auto hook = std::make_shared<OpHook>(OpHook{false, false, g.get(), &op});
  const std::stop_token token = co_await this_stop_token();
  std::optional<std::stop_callback<std::function<void()>>> on_stop;
  // A send on the wire cannot be taken back from the receiver's view: cancelling it aborts the group.
  if (token.stop_possible()) {
    on_stop.emplace(token, std::function<void()>([g, hook, tag] {
      g->loop->post([g, hook, tag] {
        if (!hook->finished) {
          g->transport->abort_context(g->context, Errc::cancelled, fmt::format("rank {} cancelled a send [tag {}]", g->rank, tag));
        }
      });
    }));
  }
  const std::uint64_t watch_id = watch_p2p(*g, hook, timeout, true);
  g->transport->start_send(g->members[static_cast<std::size_t>(dst)], MessageKey{g->context, 0, tag}, data.data, data.bytes(), op);
  co_await op.wait();
  hook->finished = true;
  if (watch_id) g->unwatch(watch_id);
  on_stop.reset();
  if (op.error()) {
    throw_error(static_cast<Errc>(op.error().value()), g->where("send", static_cast<std::int64_t>(op_seq), dst, tag), op.reason());
  }
}

Task<void> recv_task(std::shared_ptr<GroupState> g, BufferView data, int src, std::uint32_t tag, std::uint64_t op_seq,
                     std::chrono::milliseconds timeout) {
  TransportOp op;
  auto hook = std::make_shared<OpHook>(OpHook{false, false, g.get(), &op});
  const std::stop_token token = co_await this_stop_token();
  std::optional<std::stop_callback<std::function<void()>>> on_stop;
  if (token.stop_possible()) {
    on_stop.emplace(token, std::function<void()>([g, hook, &op] {
      g->loop->post([g, hook, &op] {
        if (!hook->finished) g->transport->cancel_recv(op);
      });
    }));
  }
  const std::uint64_t watch_id = watch_p2p(*g, hook, timeout, false);
  g->transport->start_recv(g->members[static_cast<std::size_t>(src)], MessageKey{g->context, 0, tag}, data.data, data.bytes(), op);
  co_await op.wait();
  hook->finished = true;
  if (watch_id) g->unwatch(watch_id);
  on_stop.reset();
  if (hook->timed_out) {
    throw_error(Errc::timeout, g->where("recv", static_cast<std::int64_t>(op_seq), src, tag),
                fmt::format("the receive from rank {} [tag {}] passed its deadline ({}) on rank {}; it was withdrawn and the "
                            "group stays usable", src, tag, GroupState::duration_text(timeout), g->rank));
  }
  if (op.error()) {
    throw_error(static_cast<Errc>(op.error().value()), g->where("recv", static_cast<std::int64_t>(op_seq), src, tag), op.reason());
  }
}

// Deterministic reduction of block `mine` of every rank: an ordered exchange brings every rank's block
// here (slot i from rank i), and the fold runs in rank order: ((x0 op x1) op x2) ...
Task<void> ordered_reduce(GroupState& g, std::uint64_t seq, Collective name, const std::byte* in,
                          std::span<const algo::Range> blocks, std::byte* dst, DType type, ReduceOp op,
                          GroupState::Call call) {
  const std::size_t esize = dtype_size(type);
  const algo::Range mine = blocks[static_cast<std::size_t>(g.rank)];
  auto slots = std::make_unique_for_overwrite<std::byte[]>(std::max<std::size_t>(1, mine.count * esize * static_cast<std::size_t>(g.size)));
  copy_bytes(slots.get() + static_cast<std::size_t>(g.rank) * mine.count * esize, in + mine.offset * esize, mine.count * esize);
  const auto plan = algo::ordered_exchange(g.size, g.rank, blocks);
  co_await g.run(plan, seq, name, algo::PlanBuffers{in, slots.get(), type, op}, call);
  algo::fold_in_rank_order(dst, slots.get(), mine.count, g.size, type, op);
}

Task<void> deterministic_all_reduce(std::shared_ptr<GroupState> g, std::uint64_t seq, Collective name,
                                    ConstBufferView in, BufferView out, ReduceOp op, GroupState::Call call) {
  const auto blocks = algo::blocks_of(out.count, g->size);
  const algo::Range mine = blocks[static_cast<std::size_t>(g->rank)];
  const std::size_t esize = dtype_size(out.dtype);
  // The fold lands after the exchange has ended, and the exchange never sends this rank's own block:
  // in place, it may write straight over the input.
  co_await ordered_reduce(*g, seq, name, in.bytes_ptr(), blocks, out.bytes_ptr() + mine.offset * esize, out.dtype, op, call);
  algo::finish_reduction(op, out.bytes_ptr() + mine.offset * esize, mine.count, out.dtype, g->size);
  const auto gather = algo::ring_all_gather(g->size, g->rank, blocks, -1);
  co_await g->run(gather, seq, name, algo::PlanBuffers{out.bytes_ptr(), out.bytes_ptr(), out.dtype, op}, call, std::uint64_t{1} << 32);
}

// Every task starts by checking that it implements the algorithm it was given: a registry entry whose
// kind a task does not handle fails here, loudly, instead of running an empty plan.
void require(const algo::Algorithm& algorithm, std::initializer_list<algo::Kind> handled) {
  if (std::find(handled.begin(), handled.end(), algorithm.kind) == handled.end()) {
    throw std::logic_error(fmt::format("weft: {} has no implementation of the algorithm '{}'", to_string(algorithm.collective),
                                       algorithm.name));
  }
}

Task<void> all_reduce_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out, ReduceOp op,
                           const algo::Algorithm& algorithm) {
  using algo::Kind;
  require(algorithm, {Kind::ring, Kind::bidirectional_ring, Kind::recursive_doubling, Kind::rabenseifner, Kind::tree});
  if (g->options.deterministic && g->size > 1) {
    co_await deterministic_all_reduce(g, seq, Collective::all_reduce, in, out, op, {out.count});
    co_return;
  }
  algo::Plan plan;
  algo::PlanBuffers buffers{out.bytes_ptr(), out.bytes_ptr(), out.dtype, op};
  if ((algorithm.kind == Kind::ring || algorithm.kind == Kind::bidirectional_ring) && g->size > 1) {
    // The rings reduce every block once and write every block of `out`: out of place, they read this
    // rank's contribution straight from `in` (no staging copy).
    plan = algorithm.kind == Kind::ring ? algo::ring_all_reduce(g->size, g->rank, out.count)
                                        : algo::bidirectional_ring_all_reduce(g->size, g->rank, out.count);
    buffers.send = in.bytes_ptr();
    if (in.data != out.data) buffers.local = in.bytes_ptr();
  } else {
    // The others run in place on `out`, sending what they have reduced so far.
    copy_bytes(out.data, in.data, out.bytes());
    // (A ring on one rank: nothing to exchange, the copy is the result.)
    if (algorithm.kind == Kind::recursive_doubling) plan = algo::recursive_doubling_all_reduce(g->size, g->rank, out.count);
    if (algorithm.kind == Kind::rabenseifner) plan = algo::rabenseifner_all_reduce(g->size, g->rank, out.count);
    if (algorithm.kind == Kind::tree) plan = algo::tree_all_reduce(g->size, g->rank, out.count);
  }
  co_await g->run(plan, seq, Collective::all_reduce, buffers, {out.count});
  algo::finish_reduction(op, out.data, out.count, out.dtype, g->size);
}

Task<void> all_gather_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out,
                           const algo::Algorithm& algorithm) {
  using algo::Kind;
  require(algorithm, {Kind::ring, Kind::bruck, Kind::recursive_doubling});
  const std::size_t block_bytes = in.bytes();
  const bool power_of_two = (g->size & (g->size - 1)) == 0;
  if (algorithm.kind == Kind::recursive_doubling && power_of_two && g->size > 1) {
    copy_bytes(out.bytes_ptr() + static_cast<std::size_t>(g->rank) * block_bytes, in.data, block_bytes);
    const auto plan = algo::recursive_doubling_all_gather(g->size, g->rank, in.count);
    co_await g->run(plan, seq, Collective::all_gather, algo::PlanBuffers{out.bytes_ptr(), out.bytes_ptr(), out.dtype, ReduceOp::sum}, {in.count});
    co_return;
  }
  // Bruck also serves recursive doubling on a non-power-of-two group (the same lg p rounds).
  if ((algorithm.kind == Kind::bruck || algorithm.kind == Kind::recursive_doubling) && g->size > 1) {
    // Bruck gathers into a rotated buffer (slot i holds rank r+i's block); rotate it into place.
    const auto p = static_cast<std::size_t>(g->size);
    auto rotated = std::make_unique_for_overwrite<std::byte[]>(std::max<std::size_t>(1, p * block_bytes));
    copy_bytes(rotated.get(), in.data, block_bytes);
    const auto plan = algo::bruck_all_gather(g->size, g->rank, in.count);
    co_await g->run(plan, seq, Collective::all_gather, algo::PlanBuffers{rotated.get(), rotated.get(), out.dtype, ReduceOp::sum}, {in.count});
    blocks_from_slots(out.bytes_ptr(), rotated.get(), p, static_cast<std::size_t>(g->rank), block_bytes);
    co_return;
  }
  copy_bytes(out.bytes_ptr() + static_cast<std::size_t>(g->rank) * block_bytes, in.data, block_bytes);
  const auto blocks = algo::blocks_of(out.count, g->size);
  const auto plan = algo::ring_all_gather(g->size, g->rank, blocks, -1);
  co_await g->run(plan, seq, Collective::all_gather, algo::PlanBuffers{out.bytes_ptr(), out.bytes_ptr(), out.dtype, ReduceOp::sum}, {in.count});
}

Task<void> reduce_scatter_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out, ReduceOp op,
                               const algo::Algorithm& algorithm) {
  using algo::Kind;
  require(algorithm, {Kind::ring, Kind::recursive_halving});
  if (g->options.deterministic && g->size > 1) {
    const auto blocks = algo::blocks_of(in.count, g->size);
    co_await ordered_reduce(*g, seq, Collective::reduce_scatter, in.bytes_ptr(), blocks, out.bytes_ptr(), out.dtype, op, {out.count});
    algo::finish_reduction(op, out.data, out.count, out.dtype, g->size);
    co_return;
  }
  const bool power_of_two = (g->size & (g->size - 1)) == 0;
  if (algorithm.kind == Kind::recursive_halving && power_of_two && g->size > 1) {
    // Halving accumulates into the same ranges round after round: it works on a copy of the input.
    auto work = std::make_unique_for_overwrite<std::byte[]>(std::max<std::size_t>(1, in.bytes()));
    copy_bytes(work.get(), in.data, in.bytes());
    const auto plan = algo::recursive_halving_reduce_scatter(g->size, g->rank, out.count);
    co_await g->run(plan, seq, Collective::reduce_scatter, algo::PlanBuffers{work.get(), work.get(), out.dtype, op}, {out.count});
    copy_bytes(out.data, work.get() + static_cast<std::size_t>(g->rank) * out.bytes(), out.bytes());
    algo::finish_reduction(op, out.data, out.count, out.dtype, g->size);
    co_return;
  }
  // The ring (also where recursive halving was asked for on a non-power-of-two group) reduces into
  // scratch, reading this rank's contributions from `in`; the rank's own block is the result. (One rank
  // has no ring: its input is the result.)
  auto work = std::make_unique_for_overwrite<std::byte[]>(in.bytes());
  if (g->size == 1) copy_bytes(work.get(), in.data, in.bytes());
  const auto blocks = algo::blocks_of(in.count, g->size);
  const auto plan = algo::ring_reduce_scatter(g->size, g->rank, blocks, -1);
  co_await g->run(plan, seq, Collective::reduce_scatter, algo::PlanBuffers{in.bytes_ptr(), work.get(), out.dtype, op, in.bytes_ptr()}, {out.count});
  copy_bytes(out.data, work.get() + static_cast<std::size_t>(g->rank) * out.bytes(), out.bytes());
  algo::finish_reduction(op, out.data, out.count, out.dtype, g->size);
}

Task<void> broadcast_task(std::shared_ptr<GroupState> g, std::uint64_t seq, BufferView data, int root,
                          const algo::Algorithm& algorithm) {
  using algo::Kind;
  require(algorithm, {Kind::binomial, Kind::scatter_all_gather});
  const auto plan = algorithm.kind == Kind::scatter_all_gather ? algo::scatter_all_gather_broadcast(g->size, g->rank, root, data.count)
                                                               : algo::binomial_broadcast(g->size, g->rank, root, data.count);
  co_await g->run(plan, seq, Collective::broadcast, algo::PlanBuffers{data.bytes_ptr(), data.bytes_ptr(), data.dtype, ReduceOp::sum},
                  {data.count, root});
}

Task<void> reduce_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out, int root, ReduceOp op,
                       const algo::Algorithm& algorithm) {
  using algo::Kind;
  require(algorithm, {Kind::binomial, Kind::reduce_scatter_gather});
  if (g->options.deterministic && g->size > 1) {
    // Every rank computes the rank-order result; only the root keeps it.
    std::unique_ptr<std::byte[]> scratch;
    BufferView result = out;
    if (g->rank != root) {
      scratch = std::make_unique_for_overwrite<std::byte[]>(std::max<std::size_t>(1, in.bytes()));
      result = BufferView(scratch.get(), in.count, in.dtype);
    }
    co_await deterministic_all_reduce(g, seq, Collective::reduce, in, result, op, {in.count, root});
    co_return;
  }
  std::unique_ptr<std::byte[]> scratch;
  std::byte* work = out.bytes_ptr();
  if (g->rank != root) {
    scratch = std::make_unique_for_overwrite<std::byte[]>(in.bytes());
    work = scratch.get();
  }
  copy_bytes(work, in.data, in.bytes());
  const auto plan = algorithm.kind == Kind::reduce_scatter_gather ? algo::reduce_scatter_gather_reduce(g->size, g->rank, root, in.count)
                                                                  : algo::binomial_reduce(g->size, g->rank, root, in.count);
  co_await g->run(plan, seq, Collective::reduce, algo::PlanBuffers{work, work, in.dtype, op}, {in.count, root});
  if (g->rank == root) algo::finish_reduction(op, out.data, out.count, out.dtype, g->size);
}

// Room for what a binomial gather or scatter plan touches on this rank (at least its own block of
// `count` elements), in virtual-order slots.
std::unique_ptr<std::byte[]> slots_for(const algo::Plan& plan, std::size_t count, DType dtype) {
  std::size_t end = count;
  for (const algo::Step& step : plan) end = std::max({end, step.send.offset + step.send.count, step.recv.offset + step.recv.count});
  return std::make_unique_for_overwrite<std::byte[]>(std::max<std::size_t>(1, end * dtype_size(dtype)));
}

Task<void> gather_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out, int root,
                       const algo::Algorithm& algorithm) {
  using algo::Kind;
  require(algorithm, {Kind::direct, Kind::binomial});
  const std::size_t block_bytes = in.bytes();
  const auto p = static_cast<std::size_t>(g->size);
  if (algorithm.kind == Kind::binomial && g->size > 1) {
    // Blocks travel in virtual order (slot i: rank root + r' + i), own block first; the root rotates.
    const auto plan = algo::binomial_gather(g->size, g->rank, root, in.count);
    auto staging = slots_for(plan, in.count, in.dtype);
    copy_bytes(staging.get(), in.data, block_bytes);
    co_await g->run(plan, seq, Collective::gather, algo::PlanBuffers{staging.get(), staging.get(), in.dtype, ReduceOp::sum}, {in.count, root});
    if (g->rank == root) blocks_from_slots(out.bytes_ptr(), staging.get(), p, static_cast<std::size_t>(root), block_bytes);
    co_return;
  }
  if (g->rank == root) copy_bytes(out.bytes_ptr() + static_cast<std::size_t>(root) * in.bytes(), in.data, in.bytes());
  const auto plan = algo::direct_gather(g->size, g->rank, root, in.count);
  co_await g->run(plan, seq, Collective::gather,
                  algo::PlanBuffers{in.bytes_ptr(), g->rank == root ? out.bytes_ptr() : nullptr, in.dtype, ReduceOp::sum},
                  {in.count, root});
}

Task<void> scatter_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out, int root,
                        const algo::Algorithm& algorithm) {
  using algo::Kind;
  require(algorithm, {Kind::direct, Kind::binomial});
  const std::size_t block_bytes = out.bytes();
  const auto p = static_cast<std::size_t>(g->size);
  if (algorithm.kind == Kind::binomial && g->size > 1) {
    const auto plan = algo::binomial_scatter(g->size, g->rank, root, out.count);
    auto staging = slots_for(plan, out.count, out.dtype);
    if (g->rank == root) slots_from_blocks(staging.get(), in.bytes_ptr(), p, static_cast<std::size_t>(root), block_bytes);
    co_await g->run(plan, seq, Collective::scatter, algo::PlanBuffers{staging.get(), staging.get(), out.dtype, ReduceOp::sum}, {out.count, root});
    copy_bytes(out.data, staging.get(), block_bytes);
    co_return;
  }
  if (g->rank == root) copy_bytes(out.data, in.bytes_ptr() + static_cast<std::size_t>(root) * out.bytes(), out.bytes());
  const auto plan = algo::direct_scatter(g->size, g->rank, root, out.count);
  co_await g->run(plan, seq, Collective::scatter,
                  algo::PlanBuffers{g->rank == root ? in.bytes_ptr() : nullptr, out.bytes_ptr(), out.dtype, ReduceOp::sum},
                  {out.count, root});
}

Task<void> all_to_all_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out,
                           const algo::Algorithm& algorithm) {
  using algo::Kind;
  require(algorithm, {Kind::pairwise, Kind::bruck});
  const std::size_t block = in.count / static_cast<std::size_t>(g->size);
  const std::size_t block_bytes = block * dtype_size(in.dtype);
  if (algorithm.kind == Kind::bruck && g->size > 1) {
    // Rotate in (slot i: the block for rank r+i), run, rotate out (slot i came from rank r-i).
    const auto p = static_cast<std::size_t>(g->size);
    const auto r = static_cast<std::size_t>(g->rank);
    auto slots = std::make_unique_for_overwrite<std::byte[]>(std::max<std::size_t>(1, p * block_bytes));
    slots_from_blocks(slots.get(), in.bytes_ptr(), p, r, block_bytes);
    const auto plan = algo::bruck_all_to_all(g->size, g->rank, block);
    co_await g->run(plan, seq, Collective::all_to_all, algo::PlanBuffers{slots.get(), slots.get(), in.dtype, ReduceOp::sum}, {in.count});
    blocks_from_slots(out.bytes_ptr(), slots.get(), p, r, block_bytes, Turn::down);
    co_return;
  }
  std::unique_ptr<std::byte[]> copy;
  const std::byte* source = in.bytes_ptr();
  if (in.data == out.data && in.bytes()) {  // in place: send from a copy
    copy = std::make_unique_for_overwrite<std::byte[]>(in.bytes());
    std::memcpy(copy.get(), in.data, in.bytes());
    source = copy.get();
  }
  copy_bytes(out.bytes_ptr() + static_cast<std::size_t>(g->rank) * block_bytes,
             source + static_cast<std::size_t>(g->rank) * block_bytes, block_bytes);
  const auto plan = algo::pairwise_all_to_all(g->size, g->rank, block);
  co_await g->run(plan, seq, Collective::all_to_all, algo::PlanBuffers{source, out.bytes_ptr(), in.dtype, ReduceOp::sum}, {in.count});
}

Task<void> barrier_task(std::shared_ptr<GroupState> g, std::uint64_t seq, const algo::Algorithm& algorithm) {
  require(algorithm, {algo::Kind::dissemination});
  const auto plan = algo::dissemination_barrier(g->size, g->rank);
  co_await g->run(plan, seq, Collective::barrier, algo::PlanBuffers{nullptr, nullptr, DType::u8, ReduceOp::sum}, {});
}

Task<void> permute_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out,
                        std::vector<std::pair<int, int>> pairs) {
  int send_to = -1;
  int recv_from = -1;
  for (auto [src, dst] : pairs) {
    if (src == g->rank) send_to = dst;
    if (dst == g->rank) recv_from = src;
  }
  std::unique_ptr<std::byte[]> copy;
  const std::byte* source = in.bytes_ptr();
  if (in.data == out.data && send_to >= 0 && in.bytes()) {
    copy = std::make_unique_for_overwrite<std::byte[]>(in.bytes());
    std::memcpy(copy.get(), in.data, in.bytes());
    source = copy.get();
  }
  algo::Plan plan;
  const algo::Range all{0, in.count};
  if (send_to == g->rank) {
    copy_bytes(out.data, source, out.bytes());
  } else {
    if (recv_from < 0 && out.bytes()) std::memset(out.data, 0, out.bytes());
    if (send_to >= 0 && recv_from >= 0) {
      plan.push_back(algo::Step{algo::StepKind::send_recv, send_to, recv_from, all, all});
    } else if (send_to >= 0) {
      plan.push_back(algo::Step{algo::StepKind::send, send_to, -1, all, {}});
    } else if (recv_from >= 0) {
      plan.push_back(algo::Step{algo::StepKind::recv, -1, recv_from, {}, all});
    }
  }
  co_await g->run(plan, seq, Collective::permute, algo::PlanBuffers{source, out.bytes_ptr(), in.dtype, ReduceOp::sum}, {in.count});
}

// A group made from `parent` (split, shrink) inherits everything but its members and context: the loop,
// the transport and its connections, the options, and the algorithm selection (the built-in table with
// WEFT_TUNING, WEFT_ALGO, Options::algorithms and override_algorithms applied).
std::shared_ptr<GroupState> child_of(const GroupState& parent) {
  auto child = std::make_shared<GroupState>();
  child->loop = parent.loop;
  child->transport = parent.transport;
  child->options = parent.options;
  child->selection = parent.selection;
  return child;
}

Task<Group> split_task(std::shared_ptr<GroupState> g, std::uint64_t seq, int color, int key) {
  // Everybody learns everybody's (color, key) through an all-gather on this group.
  std::vector<std::int32_t> mine{color, key};
  std::vector<std::int32_t> all(static_cast<std::size_t>(2 * g->size));
  copy_bytes(all.data() + 2 * g->rank, mine.data(), 2 * sizeof(std::int32_t));
  const auto blocks = algo::blocks_of(2 * static_cast<std::size_t>(g->size), g->size);
  const auto plan = algo::ring_all_gather(g->size, g->rank, blocks, -1);
  auto* bytes = reinterpret_cast<std::byte*>(all.data());
  co_await g->run(plan, seq, Collective::split, algo::PlanBuffers{bytes, bytes, DType::i32, ReduceOp::sum}, {});
  if (color < 0) co_return Group();
  std::vector<std::pair<std::pair<int, int>, int>> chosen;  // ((key, parent rank), parent rank)
  for (int r = 0; r < g->size; ++r) {
    if (all[static_cast<std::size_t>(2 * r)] == color) chosen.push_back({{all[static_cast<std::size_t>(2 * r + 1)], r}, r});
  }
  std::sort(chosen.begin(), chosen.end());
  auto child = child_of(*g);
  child->context = derive_context(g->context, seq, color);
  child->size = static_cast<int>(chosen.size());
  for (int i = 0; i < child->size; ++i) {
    const int parent_rank = chosen[static_cast<std::size_t>(i)].second;
    if (parent_rank == g->rank) child->rank = i;
    child->members.push_back(g->members[static_cast<std::size_t>(parent_rank)]);
  }
  child->transport->open_context(child->context, child->members);
  co_return Group(std::move(child));
}

// ---------------------------------------------------------------- shrink

// The survivors agree on who they are, in rounds: each rank sends the set of members it still reaches
// (its view) to every member of that view and receives theirs; a member that fails, does not answer within
// `patience` (its connection is then closed) or leaves this rank out is dropped, and the view becomes the
// intersection of the views received. When a round changes nothing for anybody, every rank of the view
// holds the same view (failures during the shrink itself aside: docs/RELIABILITY.md), and it becomes the
// new group, ordered as in this one, with a context derived from the view.
Task<Group> shrink_task(std::shared_ptr<GroupState> g, std::uint64_t index) {
  const int p = g->size;
  const auto me = static_cast<std::size_t>(g->rank);
  const std::uint32_t exchange = derive_context(g->context, (std::uint64_t{1} << 62) | index, -2);
  const auto patience = std::clamp<std::chrono::milliseconds>(
      g->options.timeout.count() > 0 ? g->options.timeout : std::chrono::milliseconds(30'000), std::chrono::milliseconds(100),
      std::chrono::milliseconds(30'000));
  std::vector<std::uint8_t> view(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) view[static_cast<std::size_t>(r)] = g->transport->connected(g->members[static_cast<std::size_t>(r)]) ? 1 : 0;

  struct Peer {
    int rank = -1;
    TransportOp send;
    TransportOp recv;
    std::vector<std::uint8_t> theirs;
  };
  struct Round {
    std::deque<Peer> peers;  // a deque: the TransportOps must not move
    std::vector<std::uint8_t> view;
  };
  for (std::uint64_t round = 0;; ++round) {
    auto state = std::make_shared<Round>();
    state->view = view;
    for (int r = 0; r < p; ++r) {
      if (r == g->rank || !view[static_cast<std::size_t>(r)]) continue;
      Peer& x = state->peers.emplace_back();
      x.rank = r;
      x.theirs.assign(static_cast<std::size_t>(p), 0);
      const MessageKey key{exchange, 0, round};
      const int peer = g->members[static_cast<std::size_t>(r)];
      g->transport->start_send(peer, key, state->view.data(), state->view.size(), x.send);
      g->transport->start_recv(peer, key, x.theirs.data(), x.theirs.size(), x.recv);
    }
    const auto timer = g->loop->call_after(patience, [g, state, patience](bool fired) {
      if (!fired) return;
      for (Peer& x : state->peers) {
        if (x.recv.done()) continue;
        g->transport->disconnect(g->members[static_cast<std::size_t>(x.rank)],
                                 fmt::format("left out by shrink on rank {}: no answer within {} ms", g->rank, patience.count()));
      }
    });
    for (Peer& x : state->peers) {
      co_await x.recv.wait();
      co_await x.send.wait();
    }
    g->loop->cancel_timer(timer);

    std::vector<std::uint8_t> next = view;
    bool everybody_agrees = true;
    for (Peer& x : state->peers) {
      const auto r = static_cast<std::size_t>(x.rank);
      if (x.recv.error() || x.send.error() || !x.theirs[me]) {
        next[r] = 0;
        everybody_agrees = false;
      }
    }
    for (Peer& x : state->peers) {
      if (!next[static_cast<std::size_t>(x.rank)]) continue;
      everybody_agrees = everybody_agrees && x.theirs == view;
      for (std::size_t i = 0; i < next.size(); ++i) next[i] = next[i] && x.theirs[i];
    }
    next[me] = 1;
    if (everybody_agrees && next == view) break;
    view = std::move(next);
  }

  auto child = child_of(*g);
  std::uint64_t fingerprint = 0;
  for (int r = 0; r < p; ++r) {
    if (!view[static_cast<std::size_t>(r)]) continue;
    if (r == g->rank) child->rank = static_cast<int>(child->members.size());
    child->members.push_back(g->members[static_cast<std::size_t>(r)]);
    fingerprint = fingerprint * 1099511628211ull + static_cast<std::uint64_t>(r) + 1;
  }
  child->size = static_cast<int>(child->members.size());
  child->context = derive_context(exchange, fingerprint, child->size);
  child->transport->open_context(child->context, child->members);
  log().info("rank {}: shrink: a group of {} from {} (this rank is {} there)", g->rank, child->size, p, child->rank);
  co_return Group(std::move(child));
}

// ---------------------------------------------------------------- the submit path

// What each buffer collective requires of its call: one row per collective, read by validate() and
// selection_bytes(), so that the public methods hold no checks of their own.
struct Rule {
  enum class Counts : std::uint8_t {
    none,          // no buffers (barrier)
    one_buffer,    // in and out are one buffer ("data": broadcast)
    equal,         // out has in's count
    out_is_p_in,   // out holds a block per rank of in's count (all_gather, gather)
    in_is_p_out,   // in holds a block per rank of out's count (reduce_scatter, scatter)
  };
  enum class Size : std::uint8_t { out, in, p_in, p_out };  // the bytes the algorithm is chosen by
  Counts counts;
  Size size;
  bool root = false;            // takes a root
  bool input_root_only = false;   // only the root's input is read (scatter)
  bool output_root_only = false;  // only the root's output is written (reduce, gather)
  bool equal_blocks = false;      // the count splits into size() equal blocks (all_to_all)
};

const Rule& rule_of(Collective c) {
  using C = Rule::Counts;
  using S = Rule::Size;
  static const Rule all_reduce{C::equal, S::out};
  static const Rule all_gather{C::out_is_p_in, S::out};
  static const Rule reduce_scatter{C::in_is_p_out, S::in};
  static const Rule broadcast{C::one_buffer, S::out, true};
  static const Rule reduce{C::equal, S::in, true, false, true};
  static const Rule gather{C::out_is_p_in, S::p_in, true, false, true};
  static const Rule scatter{C::in_is_p_out, S::p_out, true, true, false};
  static const Rule all_to_all{C::equal, S::in, false, false, false, true};
  static const Rule barrier{C::none, S::in};
  switch (c) {
    case Collective::all_reduce: return all_reduce;
    case Collective::all_gather: return all_gather;
    case Collective::reduce_scatter: return reduce_scatter;
    case Collective::broadcast: return broadcast;
    case Collective::reduce: return reduce;
    case Collective::gather: return gather;
    case Collective::scatter: return scatter;
    case Collective::all_to_all: return all_to_all;
    case Collective::barrier: return barrier;
    case Collective::permute:
    case Collective::split: break;
  }
  throw std::logic_error(fmt::format("weft: {} does not go through the submit path", to_string(c)));
}

// The preconditions of `call` on this rank, from its collective's rule. Errors: weft::Error
// (invalid_argument) naming the operation, before anything is sent.
void validate(GroupState& g, const detail::CollectiveCall& call) {
  const char* name = to_string(call.collective).data();
  const Rule& rule = rule_of(call.collective);
  if (rule.root) check_rank(g, name, "root", call.root);
  if (rule.counts == Rule::Counts::none) return;
  if (rule.counts == Rule::Counts::one_buffer) {
    check_buffer(g, name, "data", call.out.data, call.out.count, call.out.dtype, call.out.device);
    return;
  }
  const bool root_here = g.rank == call.root;
  const bool input_here = !rule.input_root_only || root_here;
  const bool output_here = !rule.output_root_only || root_here;
  if (input_here) check_buffer(g, name, "input", call.in.data, call.in.count, call.in.dtype, call.in.device);
  if (reduces(call.collective)) check_op(g, name, call.in.dtype, call.op);
  if (output_here) check_buffer(g, name, "output", call.out.data, call.out.count, call.out.dtype, call.out.device);
  if (!input_here || !output_here) return;  // a rank that uses one of the buffers: nothing to compare
  check_same_type(g, name, call.in.dtype, call.out.dtype);
  switch (rule.counts) {
    case Rule::Counts::equal: check_count(g, name, "output", call.out.count, call.in.count); break;
    case Rule::Counts::out_is_p_in: check_count(g, name, "output", call.out.count, per_rank_total(g, name, call.in.count)); break;
    case Rule::Counts::in_is_p_out: check_count(g, name, "input", call.in.count, per_rank_total(g, name, call.out.count)); break;
    case Rule::Counts::none:
    case Rule::Counts::one_buffer: break;
  }
  if (rule.equal_blocks && call.in.count % static_cast<std::size_t>(g.size) != 0) {
    invalid(g, name, fmt::format("{} elements do not split into {} equal blocks", call.in.count, g.size));
  }
}

// The bytes the selection table looks at for `call`.
std::size_t selection_bytes(const GroupState& g, const detail::CollectiveCall& call) {
  const auto p = static_cast<std::size_t>(g.size);
  switch (rule_of(call.collective).size) {
    case Rule::Size::out: return call.out.bytes();
    case Rule::Size::in: return call.in.bytes();
    case Rule::Size::p_in: return call.in.bytes() * p;
    case Rule::Size::p_out: return call.out.bytes() * p;
  }
  return 0;
}

// The task of `call`'s collective (not a coroutine: no frame of its own).
Task<void> start_collective(std::shared_ptr<GroupState> g, std::uint64_t seq, const detail::CollectiveCall& call,
                            const algo::Algorithm& algorithm) {
  switch (call.collective) {
    case Collective::all_reduce: return all_reduce_task(std::move(g), seq, call.in, call.out, call.op, algorithm);
    case Collective::all_gather: return all_gather_task(std::move(g), seq, call.in, call.out, algorithm);
    case Collective::reduce_scatter: return reduce_scatter_task(std::move(g), seq, call.in, call.out, call.op, algorithm);
    case Collective::broadcast: return broadcast_task(std::move(g), seq, call.out, call.root, algorithm);
    case Collective::reduce: return reduce_task(std::move(g), seq, call.in, call.out, call.root, call.op, algorithm);
    case Collective::gather: return gather_task(std::move(g), seq, call.in, call.out, call.root, algorithm);
    case Collective::scatter: return scatter_task(std::move(g), seq, call.in, call.out, call.root, algorithm);
    case Collective::all_to_all: return all_to_all_task(std::move(g), seq, call.in, call.out, algorithm);
    case Collective::barrier: return barrier_task(std::move(g), seq, algorithm);
    case Collective::permute:
    case Collective::split: break;
  }
  throw std::logic_error(fmt::format("weft: {} does not go through the submit path", to_string(call.collective)));
}

}  // namespace

// ---------------------------------------------------------------- Group

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
  if (options.integrity == Integrity::hmac && options.secret.empty()) {
    throw Error(Errc::invalid_argument, ErrorContext{.rank = options.rank, .op = "configuration"},
                "WEFT_INTEGRITY=hmac (Options::integrity) needs a shared secret to key its MACs: set WEFT_SECRET or "
                "WEFT_SECRET_FILE on every rank (or use crc32c, which needs none)");
  }
  // Algorithm choices: the built-in table, then a tuning file, then WEFT_ALGO. Malformed ones fail here.
  algo::Selection selection;
  if (!options.tuning_file.empty()) {
    std::ifstream file(options.tuning_file);
    if (!file) {
      throw Error(Errc::invalid_argument, ErrorContext{.rank = options.rank, .op = "configuration"},
                  fmt::format("cannot read the tuning file '{}' (WEFT_TUNING)", options.tuning_file));
    }
    std::string content;
    for (std::string line; std::getline(file, line);) {
      if (line.empty() || line[0] == '#') continue;
      content += line + ";";
    }
    selection.override_with(content, "the tuning file " + options.tuning_file);
  }
  selection.override_with(options.algorithms, "WEFT_ALGO");
  return spawn(loop, create_task(&loop, std::move(options), std::move(selection)));
}

detail::GroupState& Group::live(const char* op) const {
  if (!state_) {
    throw Error(Errc::invalid_argument, ErrorContext{.op = op},
                "this Group is empty (default-constructed, moved from, or what split() gave a rank with a negative "
                "color): it has no ranks to talk to");
  }
  return *state_;
}

void Group::override_algorithms(std::string_view spec) { live("override_algorithms").selection.override_with(spec, "override_algorithms"); }

std::string Group::algorithm_for(std::string_view collective, std::size_t bytes) const {
  const auto& g = live("algorithm_for");
  const auto known = collective_named(collective);
  if (!known) {
    throw Error(Errc::invalid_argument, ErrorContext{.rank = g.rank, .op = "algorithm_for"},
                fmt::format("'{}' is not a collective", collective));
  }
  const algo::Algorithm* chosen = g.selection.choose(*known, bytes, g.size);
  return chosen ? std::string(chosen->name) : std::string();
}

int Group::rank() const noexcept { return state_ ? state_->rank : -1; }
int Group::size() const noexcept { return state_ ? state_->size : 0; }
std::string_view Group::transport_name() const noexcept { return state_ ? state_->transport->name() : std::string_view(); }
Loop& Group::loop() const { return *live("loop").loop; }

Future<void> Group::send(ConstBufferView data, int dst, std::uint32_t tag) {
  auto& g = live("send");
  check_usable(g, "send");
  check_rank(g, "send", "destination", dst);
  check_buffer(g, "send", "data", data.data, data.count, data.dtype, data.device);
  return spawn(*g.loop, send_task(state_, data, dst, tag, 0, timeout_.count() >= 0 ? timeout_ : g.options.timeout));
}

Future<void> Group::recv(BufferView data, int src, std::uint32_t tag) {
  auto& g = live("recv");
  check_usable(g, "recv");
  check_rank(g, "recv", "source", src);
  check_buffer(g, "recv", "data", data.data, data.count, data.dtype, data.device);
  return spawn(*g.loop, recv_task(state_, data, src, tag, 0, timeout_.count() >= 0 ? timeout_ : g.options.timeout));
}

Future<void> Group::all_reduce(BufferView data, ReduceOp op) { return all_reduce(ConstBufferView(data), data, op); }

Future<void> Group::all_reduce(ConstBufferView in, BufferView out, ReduceOp op) {
  return submit(detail::CollectiveCall{Collective::all_reduce, in, out, op});
}
Future<void> Group::all_gather(ConstBufferView in, BufferView out) {
  return submit(detail::CollectiveCall{Collective::all_gather, in, out});
}
Future<void> Group::reduce_scatter(ConstBufferView in, BufferView out, ReduceOp op) {
  return submit(detail::CollectiveCall{Collective::reduce_scatter, in, out, op});
}
Future<void> Group::broadcast(BufferView data, int root) {
  return submit(detail::CollectiveCall{Collective::broadcast, data, data, ReduceOp::sum, root});
}
Future<void> Group::reduce(ConstBufferView in, BufferView out, int root, ReduceOp op) {
  return submit(detail::CollectiveCall{Collective::reduce, in, out, op, root});
}
Future<void> Group::gather(ConstBufferView in, BufferView out, int root) {
  return submit(detail::CollectiveCall{Collective::gather, in, out, ReduceOp::sum, root});
}
Future<void> Group::scatter(ConstBufferView in, BufferView out, int root) {
  return submit(detail::CollectiveCall{Collective::scatter, in, out, ReduceOp::sum, root});
}
Future<void> Group::all_to_all(ConstBufferView in, BufferView out) {
  return submit(detail::CollectiveCall{Collective::all_to_all, in, out});
}

Future<void> Group::submit(const detail::CollectiveCall& call) {
  const char* name = to_string(call.collective).data();
  auto& g = live(name);
  check_usable(g, name);
  validate(g, call);
  // Chosen on the caller's thread, where override_algorithms changes the table.
  const algo::Algorithm& algorithm = *g.selection.choose(call.collective, selection_bytes(g, call), g.size);
  return spawn(*g.loop, start_collective(state_, take_seq(g, timeout_), call, algorithm));
}

Future<void> Group::barrier() { return submit(detail::CollectiveCall{Collective::barrier, {}, {}}); }

Future<void> Group::permute(ConstBufferView in, BufferView out, std::vector<std::pair<int, int>> pairs) {
  const char* name = "permute";
  auto& g = live(name);
  check_usable(g, name);
  check_buffer(g, name, "input", in.data, in.count, in.dtype, in.device);
  check_buffer(g, name, "output", out.data, out.count, out.dtype, out.device);
  check_same_type(g, name, in.dtype, out.dtype);
  check_count(g, name, "output", out.count, in.count);
  std::vector<int> sends(static_cast<std::size_t>(g.size), 0);
  std::vector<int> recvs(static_cast<std::size_t>(g.size), 0);
  for (auto [src, dst] : pairs) {
    check_rank(g, name, "source", src);
    check_rank(g, name, "destination", dst);
    if (++sends[static_cast<std::size_t>(src)] > 1) invalid(g, name, fmt::format("rank {} sends more than once", src), src);
    if (++recvs[static_cast<std::size_t>(dst)] > 1) invalid(g, name, fmt::format("rank {} receives more than once", dst), dst);
  }
  return spawn(*g.loop, permute_task(state_, take_seq(g, timeout_), in, out, std::move(pairs)));
}

namespace {
Task<void> plan_task(std::shared_ptr<GroupState> g, std::uint64_t seq, algo::Plan plan, algo::PlanBuffers buffers,
                     const char* name) {
  co_await g->run_signed(plan, seq, name, signature::of_plan(buffers.dtype, buffers.op, 0), buffers);
}
}  // namespace

Future<void> Group::run_plan(algorithms::Plan plan, algorithms::PlanBuffers buffers, const char* name) {
  auto& g = live(name);
  check_usable(g, name);
  for (const auto& step : plan) {
    const bool sends = step.kind != algo::StepKind::recv && step.kind != algo::StepKind::recv_reduce;
    const bool receives = step.kind != algo::StepKind::send;
    if (sends) check_rank(g, name, "send_to", step.send_to);
    if (receives) check_rank(g, name, "recv_from", step.recv_from);
    const bool reduces = step.kind == algo::StepKind::recv_reduce || step.kind == algo::StepKind::recv_reduce_send ||
                         step.kind == algo::StepKind::send_recv_reduce;
    if (reduces) check_op(g, name, buffers.dtype, buffers.op);
  }
  return spawn(*g.loop, plan_task(state_, take_seq(g, timeout_), std::move(plan), buffers, name));
}

Group Group::with_timeout(std::chrono::milliseconds timeout) const {
  live("with_timeout");
  Group view(state_);
  view.timeout_ = std::max(timeout, std::chrono::milliseconds(0));
  return view;
}

Future<Group> Group::shrink() {
  auto& g = live("shrink");
  return spawn(*g.loop, shrink_task(state_, g.shrinks.fetch_add(1)));
}

void Group::abort(const std::string& reason) {
  auto& g = live("abort");
  const std::string text = reason.empty() ? fmt::format("rank {} called abort()", g.rank)
                                          : fmt::format("rank {} called abort(): {}", g.rank, reason);
  g.mark_failed(text);
  g.loop->post([state = state_, text] { state->transport->abort_context(state->context, Errc::aborted, text); });
}

Future<Group> Group::split(int color, int key) {
  auto& g = live("split");
  check_usable(g, "split");
  return spawn(*g.loop, split_task(state_, take_seq(g, timeout_), color, key));
}

}  // namespace weft
