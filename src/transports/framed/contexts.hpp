#pragma once
// The contexts of the framed transport: per context, its members, its failure (the first one wins), the
// signatures of the latest operations seen (this rank's and early arrivals') and the operations cancelled
// here. Plain state on the loop's thread (but for the flag that some context failed, which any thread
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

struct ContextState {
  std::vector<int> members;
  bool failed = false;
  std::atomic<bool>* any_failed = nullptr;  // the table's flag, set with `failed`
  std::error_code code;
  std::string reason;
  int failed_peer = -1;
  // Marks the context failed; false (and nothing changes) when it had failed already: the first failure
  // is the one every operation reports.
  bool fail(std::error_code why, int peer, std::string text) {
    if (failed) return false;
    failed = true;
    if (any_failed) any_failed->store(true, std::memory_order_release);
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
    state.any_failed = &any_failed_;
    return state;
  }
  /// Whether some context failed so far. Any thread.
  bool any_failed() const noexcept { return any_failed_.load(std::memory_order_acquire); }
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
  std::atomic<bool> any_failed_{false};
  std::uint32_t cached_context_ = 0;
  ContextState* cached_state_ = nullptr;
  MessageKey last_noted_{};
};

}  // namespace weft
