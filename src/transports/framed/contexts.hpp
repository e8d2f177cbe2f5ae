#pragma once
// The contexts of the framed transport: per context, its members, its failure (the first one wins), the
// signatures of the latest operations seen (this rank's and early arrivals') and the operations cancelled
// here. Plain state on the loop's thread (but for the ids of the failed contexts, which any thread
// may read); the transport acts on it (aborts, completes operations).
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include "weft/transport.hpp"

namespace weft {

// The ids of the contexts that failed, for threads other than the loop's (the group arena's fast path
// asks, on the caller's thread, whether its own context failed, where the table itself is the loop's).
// The first `size` failures are remembered exactly; past them every context may have failed, which only
// sends a caller to the loop, where the table answers. One writer: the loop's thread.
class FailedContexts {
 public:
  static constexpr std::size_t size = 16;
  void add(std::uint32_t context) noexcept {
    const std::size_t n = count_.load(std::memory_order_relaxed);
    if (n < size) ids_[n].store(context, std::memory_order_relaxed);
    count_.store(n + 1, std::memory_order_release);  // the id is published before the count that shows it
  }
  /// False only when `context` is known not to have failed. Any thread.
  bool may_contain(std::uint32_t context) const noexcept {
    const std::size_t n = count_.load(std::memory_order_acquire);
    if (n > size) return true;
    for (std::size_t i = 0; i < n; ++i) {
      if (ids_[i].load(std::memory_order_relaxed) == context) return true;
    }
    return false;
  }

 private:
  std::array<std::atomic<std::uint32_t>, size> ids_{};
  std::atomic<std::size_t> count_{0};
};

struct ContextState {
  std::vector<int> members;
  bool failed = false;
  std::uint32_t id = 0;
  FailedContexts* failures = nullptr;  // the table's record, told with `failed`
  std::error_code code;
  std::string reason;
  int failed_peer = -1;
  // Marks the context failed; false (and nothing changes) when it had failed already: the first failure
  // is the one every operation reports.
  bool fail(std::error_code why, int peer, std::string text) {
    if (failed) return false;
    failed = true;
    if (failures) failures->add(id);
    code = why;
    failed_peer = peer;
    reason = std::move(text);
    return true;
  }

  // The signatures of the latest operations seen in this context: this rank's own (`local`) and those
  // of messages that arrived before their receive (`early`). A mismatch that no receive would meet
  // (two ranks that both think they are the root of a broadcast only send) is caught by comparing the
  // two. Fixed rings of the latest 64: a check runs per message and must cost little.
  struct Seen {
    std::uint64_t seq = 0;
    OpSignature signature{};
    int peer = -1;
  };
  // Entries are numbered by push (1, 2, ...) and chained by seq % 64, latest first, so that a search
  // visits only the entries that may be of its seq. (It used to walk the ring from the latest back until
  // a little past the seq sought: a receiver behind its senders, whose early ring holds only later seqs,
  // walked all 64 on every operation, 950 instructions of a 7,400-instruction broadcast.)
  struct Recent {
    static constexpr std::size_t size = 64;
    std::array<Seen, size> ring{};
    std::array<std::size_t, size> previous{};  // by ring slot: that entry's previous one of its chain (0: none)
    std::array<std::size_t, size> chain{};     // by seq % size: the latest entry of that chain (0: none)
    std::size_t pushed = 0;                    // entries numbered 1 .. pushed; the latest `size` are kept
    void push(const Seen& seen) noexcept {
      const std::size_t slot = pushed % size;
      ring[slot] = seen;
      previous[slot] = chain[seen.seq % size];
      chain[seen.seq % size] = ++pushed;
    }
    const Seen* latest() const noexcept { return pushed ? &ring[(pushed - 1) % size] : nullptr; }
    // The entries kept for `seq`, latest first: fn(entry) until it returns true; that entry, or null.
    template <class Fn>
    const Seen* first_of(std::uint64_t seq, Fn fn) const noexcept {
      for (std::size_t number = chain[seq % size]; number != 0 && pushed - number < size; number = previous[(number - 1) % size]) {
        const Seen& seen = ring[(number - 1) % size];
        if (seen.seq == seq && fn(seen)) return &seen;
      }
      return nullptr;
    }
    // This rank's entry for `seq`, if still kept.
    const Seen* find(std::uint64_t seq) const noexcept {
      return first_of(seq, [](const Seen&) { return true; });
    }
    // The latest entry for `seq` whose signature differs from `signature`.
    const Seen* disagreeing(std::uint64_t seq, const OpSignature& signature) const noexcept {
      return first_of(seq, [&](const Seen& seen) { return !(seen.signature == signature); });
    }
  };
  Recent local, early;
  std::uint64_t started = 0;  // the latest operation this rank started here (answers progress queries)

  // Operations cancelled here (the latest 64), with the reason: their later operations fail and their
  // arriving messages are dropped.
  std::deque<std::pair<std::uint64_t, std::string>> cancelled;
  const std::string* cancellation(std::uint64_t seq) const noexcept {
    for (const auto& [s, reason] : cancelled) {
      if (s == seq) return &reason;
    }
    return nullptr;
  }
  void note_cancelled(std::uint64_t seq, const std::string& why) {
    cancelled.emplace_back(seq, why);
    if (cancelled.size() > 64) cancelled.pop_front();
  }
};

// Every context by id. `find` remembers the last one looked up: a check runs per message, and a job
// mostly talks in one context at a time.
class ContextTable {
 public:
  ContextState& at(std::uint32_t context) {  // created when new
    ContextState& state = contexts_[context];
    state.id = context;
    state.failures = &failures_;
    return state;
  }
  /// False only when `context` is known not to have failed so far. Any thread.
  bool may_have_failed(std::uint32_t context) const noexcept { return failures_.may_contain(context); }
  ContextState* find(std::uint32_t context) noexcept {
    if (cached_state_ && cached_context_ == context) return cached_state_;
    auto it = contexts_.find(context);
    if (it == contexts_.end()) return nullptr;
    cached_context_ = context;
    cached_state_ = &it->second;
    return cached_state_;
  }
  const ContextState* find(std::uint32_t context) const noexcept {
    auto it = contexts_.find(context);
    return it == contexts_.end() ? nullptr : &it->second;
  }
  void erase(std::uint32_t context) noexcept {
    contexts_.erase(context);
    cached_state_ = nullptr;
  }
  auto begin() noexcept { return contexts_.begin(); }
  auto end() noexcept { return contexts_.end(); }

  // Whether (context, seq) is the operation whose signature was noted last, and remembering it: an
  // operation's later messages ask again, and must cost nothing.
  bool noted_last(std::uint32_t context, std::uint64_t seq) const noexcept {
    return context == last_noted_.context && seq == last_noted_.seq;
  }
  void note_last(std::uint32_t context, std::uint64_t seq) noexcept { last_noted_ = MessageKey{context, seq, 0}; }

 private:
  std::unordered_map<std::uint32_t, ContextState> contexts_;
  FailedContexts failures_;
  std::uint32_t cached_context_ = 0;
  ContextState* cached_state_ = nullptr;
  MessageKey last_noted_{};
};

}  // namespace weft
