// Deadlines (Options::timeout, Group::with_timeout): the watchdog that finds late operations, and the
// report that names who had not joined them (a progress query to every member) or who called them
// differently. Loop thread only, but for set_deadline (callers).
#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/signature.hpp"
#include "group/state.hpp"
#include "transports/shm/arena.hpp"

namespace weft::detail {

void GroupState::set_deadline(std::uint64_t seq, std::chrono::milliseconds timeout) {
  std::lock_guard lock(deadlines_mutex);
  deadlines[deadlines_pushed++ % deadlines.size()] = {seq, timeout};
  any_deadline_set.store(true, std::memory_order_release);
}

std::chrono::milliseconds GroupState::deadline_of(std::uint64_t seq) {
  if (any_deadline_set.load(std::memory_order_acquire)) {
    std::lock_guard lock(deadlines_mutex);
    for (const auto& [s, t] : deadlines) {
      if (s == seq) return t;
    }
  }
  return options.timeout;
}

void GroupState::watch(std::uint64_t seq, const char* op) {
  auto timeout = deadline_of(seq);
  // Without a deadline a collective is still watched, for the stall checks alone (check_calls): a
  // worker waiting hours on a broadcast without a deadline is where a silent mismatch hurts most.
  if (timeout.count() <= 0) timeout = no_deadline;
  watch(Watched{seq, start_of(timeout), timeout, op});
}

void GroupState::watch(Watched w) {
  watched.push_back(std::move(w));
  if (!watchdog_armed) arm_watchdog();
}

void GroupState::arm_watchdog() {
  watchdog_armed = true;
  auto shortest = options.timeout.count() > 0 ? options.timeout : std::chrono::milliseconds(1000);
  for (const Watched& w : watched) shortest = std::min(shortest, w.timeout);
  const auto period = std::min<std::chrono::milliseconds>(shortest / 4, std::chrono::milliseconds(250));
  loop->call_after(std::max(period, std::chrono::milliseconds(1)), [weak = weak_from_this()](bool) {
    if (auto self = weak.lock()) self->on_watchdog();
  });
}

void GroupState::unwatch(std::uint64_t id) {
  if (watched.empty()) return;
  if (watched.front().id == id) {
    watched.pop_front();
    return;
  }
  if (watched.back().id == id) {
    watched.pop_back();
    return;
  }
  const auto it = std::find_if(watched.begin(), watched.end(), [id](const Watched& w) { return w.id == id; });
  if (it != watched.end()) watched.erase(it);
}

void GroupState::on_watchdog() {
  watchdog_armed = false;
  const auto now = std::chrono::steady_clock::now();
  std::vector<Watched> late;
  for (Watched& w : watched) {
    if (w.started == std::chrono::steady_clock::time_point{}) w.started = now;  // start_of's late stamp
    if (now - w.started >= w.timeout) late.push_back(w);
  }
  // Collectives that run long before their deadline: asked once per doubling of their wait whether a
  // member called them differently (check_calls).
  std::vector<Watched> stalled;
  for (Watched& w : watched) {
    if (w.op == nullptr || w.expire) continue;
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - w.started);
    // Not when the deadline comes before the answers could: its own query would wait for this one.
    if (waited < w.next_check || w.timeout - waited <= stall_check_patience) continue;
    w.next_check = std::min(waited + std::max(waited, stall_check_first), waited + stall_check_most);
    stalled.push_back(w);
  }
  for (const Watched& w : stalled) {
    check_calls(w.id, w.op, std::chrono::duration_cast<std::chrono::milliseconds>(now - w.started));
  }
  // Expiring completes operations, whose coroutines then unwatch: work on the copy.
  for (const Watched& w : late) {
    if (w.expire) {
      // Only while still watched: an earlier expiry may have completed its owner, which unwatched and
      // may be gone.
      const bool watching = std::any_of(watched.begin(), watched.end(), [&](const Watched& v) { return v.id == w.id; });
      if (watching) w.expire(w.context);
    } else {
      time_out(w.id, w.op, w.timeout);
    }
  }
  if (!watched.empty() && !watchdog_armed) arm_watchdog();
}

std::string GroupState::duration_text(std::chrono::milliseconds t) {
  const auto ms = t.count();
  return ms % 1000 == 0 ? fmt::format("{} s", ms / 1000) : fmt::format("{} ms", ms);
}

// A deadline passed: before failing, ask every member how far it is (a progress query, answered by
// its transport's loop), so that the report names the ranks that had not joined the operation, not only
// the neighbours this rank waits on (in a ring, most ranks wait on a rank that waits on the late one).
void GroupState::time_out(std::uint64_t seq, const char* op, std::chrono::milliseconds timeout) {
  if (std::find(reporting.begin(), reporting.end(), seq) != reporting.end()) return;
  reporting.push_back(seq);
  std::vector<std::string> names;
  std::vector<int> peers = transport->waiting_on(context, seq);
  // A collective in the group arena waits on the ranks that have not published its step yet.
  if (peers.empty() && arena && arena_seq == seq) {
    for (int r : arena->behind()) peers.push_back(members[static_cast<std::size_t>(r)]);
  }
  for (int peer : peers) names.push_back(std::to_string(group_rank(peer)));
  const std::string after = duration_text(timeout);
  // A call on device windows waits in its kernel for the other ranks' devices; no message is missing.
  const std::string whom = !names.empty()               ? fmt::format("rank{} {}", names.size() > 1 ? "s" : "", fmt::join(names, ", "))
                           : device_windows_seq == seq ? std::string("the other ranks' devices (its kernel waits at the device windows' barrier)")
                                                       : std::string("no peer (the operation had not reached the network)");
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

// A collective that has waited `waited` (before its deadline): ask every member how it called it
// (the query a deadline makes), and fail it as a mismatch if one called it differently. Nothing else
// comes of the answers: a member behind, or one that does not answer, is the deadline's to judge.
void GroupState::check_calls(std::uint64_t seq, const char* op, std::chrono::milliseconds waited) {
  if (std::find(reporting.begin(), reporting.end(), seq) != reporting.end()) return;
  reporting.push_back(seq);
  const std::string head = fmt::format("{} #{} has waited {} on rank {}", op, seq, duration_text(waited), rank);
  transport->ask_progress(context, seq, stall_check_patience, [weak = weak_from_this(), seq, head](std::vector<Transport::Progress> answers) {
    auto self = weak.lock();
    if (!self) return;
    std::erase(self->reporting, seq);
    const bool still_running = std::any_of(self->watched.begin(), self->watched.end(), [&](const Watched& w) { return w.id == seq; });
    if (!still_running) return;
    if (const std::string calls = self->mismatched_calls(seq, answers); !calls.empty()) {
      self->transport->abort_context(self->context, Errc::mismatch, head + "; the ranks called it differently: " + calls);
    }
  });
}

// "rank 2 called reduce #1 (f32 x 8, sum, root 2) while rank 0 called reduce #1 (f32 x 8, sum, root 0)",
// or empty when every member that answered called operation `seq` as this rank did (or not yet).
std::string GroupState::mismatched_calls(std::uint64_t seq, const std::vector<Transport::Progress>& answers) const {
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

int GroupState::group_rank(int transport_rank) const {
  const auto it = std::find(members.begin(), members.end(), transport_rank);
  return it == members.end() ? -1 : static_cast<int>(it - members.begin());
}

// "not joined: rank 3 (no answer within 125 ms: stopped, hung, or busy outside weft), rank 2 (latest #4)".
std::string GroupState::stragglers(std::uint64_t seq, const std::vector<Transport::Progress>& answers, std::chrono::milliseconds patience) const {
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

}  // namespace weft::detail
