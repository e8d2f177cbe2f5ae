#pragma once
// Tag matching of the framed transport: per (peer, message key), the receives posted before their message
// and the messages that arrived before their receive (early messages), each oldest first, so that two
// messages with one key meet their receives in the order both were issued. The early messages' memory is
// charged against a limit (Options::max_early_bytes) and pooled for reuse. Loop thread only.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "weft/transport.hpp"

namespace weft {

// Oldest-first queue of a mailbox: nothing is allocated until the first push (a mailbox is made and
// erased for about every message, and std::deque allocates its map and a 512-byte block when made: four
// of a small all_reduce's 24 allocations, bench/RESULTS.md "The per-operation floor"). A mailbox holds one
// item nearly always (keys carry per-peer counters), so a vector with a moving front is enough.
template <class T>
class Fifo {
 public:
  bool empty() const noexcept { return head_ == items_.size(); }
  std::size_t size() const noexcept { return items_.size() - head_; }
  T& front() noexcept { return items_[head_]; }
  const T& front() const noexcept { return items_[head_]; }
  void push_back(T item) { items_.push_back(std::move(item)); }
  void pop_front() {
    items_[head_] = T{};
    if (++head_ == items_.size()) clear();
  }
  std::span<const T> items() const noexcept { return {items_.data() + head_, size()}; }
  auto begin() noexcept { return items_.begin() + static_cast<std::ptrdiff_t>(head_); }
  auto end() noexcept { return items_.end(); }
  auto begin() const noexcept { return items_.begin() + static_cast<std::ptrdiff_t>(head_); }
  auto end() const noexcept { return items_.end(); }
  void erase(typename std::vector<T>::iterator at) {
    items_.erase(at);
    if (empty()) clear();
  }
  void clear() noexcept {
    items_.clear();
    head_ = 0;
  }

 private:
  std::vector<T> items_;
  std::size_t head_ = 0;
};

class Matcher {
 public:
  struct Key {
    int peer;
    MessageKey key;
    friend bool operator==(const Key&, const Key&) = default;
  };
  struct KeyHash {
    std::size_t operator()(const Key& k) const noexcept;
  };

  // Bytes counted against the early-message limit while an Early holds them. The counter is the
  // matcher's, declared before every container of Earlies (so it outlives them); the transport's
  // destructor releases the charge of a connection's message in flight, as a connection may outlive the
  // transport in a pending Asio handler.
  class Charge {
   public:
    Charge() = default;
    Charge(std::size_t* total, std::size_t bytes) noexcept : total_(total), bytes_(bytes) { *total_ += bytes_; }
    Charge(Charge&& other) noexcept : total_(std::exchange(other.total_, nullptr)), bytes_(other.bytes_) {}
    Charge& operator=(Charge&& other) noexcept {
      release();
      total_ = std::exchange(other.total_, nullptr);
      bytes_ = other.bytes_;
      return *this;
    }
    ~Charge() { release(); }
    void release() noexcept {
      if (total_) *total_ -= bytes_;
      total_ = nullptr;
    }

   private:
    std::size_t* total_ = nullptr;
    std::size_t bytes_ = 0;
  };

  // A message that arrived before its receive (or the buffer it is being read into).
  struct Early {
    std::unique_ptr<std::byte[]> data;
    std::size_t bytes = 0;
    std::size_t capacity = 0;
    OpSignature signature{};  // of the operation it belongs to
    Charge charge;            // for messages from peers
  };

  struct Mailbox {
    Fifo<TransportOp*> posted;  // receives waiting for a message, oldest first
    Fifo<Early> early;          // messages waiting for a receive, oldest first
  };

  // ---- the early-message limit and the buffer pool
  void set_limit(std::size_t bytes) noexcept { limit_ = bytes; }
  std::size_t limit() const noexcept { return limit_; }
  std::size_t charged() const noexcept { return charged_; }
  // Whether `bytes` more of early messages fit under the limit (checked before anything is allocated).
  bool fits(std::size_t bytes) const noexcept { return bytes <= limit_ && charged_ <= limit_ - bytes; }
  Charge charge(std::size_t bytes) noexcept { return Charge(&charged_, bytes); }
  // A buffer of `bytes`, from the pool when one of a close size is kept; may throw std::bad_alloc.
  Early take_buffer(std::size_t bytes);
  // Releases the message's charge and keeps its buffer for reuse (up to early_buffer_pool_bytes).
  void give_back(Early&& buffer);

  // ---- matching
  void post(const Key& key, TransportOp& op) {
    if (!lone_.op && mailboxes_.empty()) {
      lone_ = Lone{key, &op};
      return;
    }
    spill();
    mailbox(key).posted.push_back(&op);
  }
  void keep_early(const Key& key, Early&& message) {
    spill();
    mailbox(key).early.push_back(std::move(message));
    ++early_count_;
  }
  // The oldest receive posted for `key`, taken out; null if none.
  TransportOp* take_posted(const Key& key) {
    return take_posted_accepted(key, [](const TransportOp&) { return true; });
  }
  // The same, only when `accept(receive)` says yes to it; null (and nothing changed) otherwise.
  template <class Accept>
  TransportOp* take_posted_accepted(const Key& key, Accept accept) {
    if (lone_.op) {  // then no mailbox exists
      if (!(lone_.key == key) || !accept(*lone_.op)) return nullptr;
      return std::exchange(lone_.op, nullptr);
    }
    auto it = find(key);
    if (it == mailboxes_.end() || it->second.posted.empty() || !accept(*it->second.posted.front())) return nullptr;
    TransportOp* op = it->second.posted.front();
    it->second.posted.pop_front();
    erase_if_empty(it);
    return op;
  }
  // The receives posted for `key`, oldest first (the next messages with that key are theirs, in that
  // order): valid until the matcher changes.
  std::span<TransportOp* const> posted(const Key& key) {
    if (lone_.op) return lone_.key == key ? std::span<TransportOp* const>(&lone_.op, 1) : std::span<TransportOp* const>{};
    if (mailboxes_.empty()) return {};
    const auto it = find(key);
    return it == mailboxes_.end() ? std::span<TransportOp* const>{} : it->second.posted.items();
  }
  // The oldest early message for `key`, left in place; null if none.
  const Early* peek_early(const Key& key) {
    if (early_count_ == 0) return nullptr;  // the usual answer for a receive posted before its message
    const auto it = find(key);
    return it == mailboxes_.end() || it->second.early.empty() ? nullptr : &it->second.early.front();
  }
  // The oldest early message for `key`, taken out; none if none.
  std::optional<Early> take_early(const Key& key);
  // Takes `op` out of its mailbox; false when it is not posted there (matched already).
  bool withdraw(TransportOp& op);

  // ---- sweeps (failures, cancels, shutdown)
  // Moves every posted receive whose key satisfies `pred` to `out`. The early messages of those keys stay
  // receivable, or, with `drop_early`, are dropped as well.
  template <class Pred>
  void take_posted_if(Pred pred, std::vector<TransportOp*>& out, bool drop_early = false) {
    // The lone receive is taken where it is (the table is empty while it is set): a failure's sweep
    // makes no mailbox.
    if (lone_.op && pred(lone_.key)) out.push_back(std::exchange(lone_.op, nullptr));
    last_valid_ = false;
    for (auto it = mailboxes_.begin(); it != mailboxes_.end();) {
      if (!pred(it->first)) {
        ++it;
        continue;
      }
      out.insert(out.end(), it->second.posted.begin(), it->second.posted.end());
      it->second.posted.clear();
      if (drop_early) {
        for (auto& message : it->second.early) give_back(std::move(message));
        early_count_ -= it->second.early.size();
        it->second.early.clear();
      }
      it = it->second.early.empty() ? mailboxes_.erase(it) : std::next(it);
    }
  }
  // Drops the early messages of `context` that no receive waits on (the context is closed).
  void forget_context(std::uint32_t context);
  // Calls fn(peer, key, message) for every early message of `context` that no receive waits on.
  template <class Fn>
  void for_each_unreceived(std::uint32_t context, Fn fn) const {
    for (const auto& [key, mailbox] : mailboxes_) {
      if (key.key.context != context || !mailbox.posted.empty()) continue;
      for (const Early& message : mailbox.early) fn(key.peer, key.key, message);
    }
  }
  bool any_posted() const noexcept;
  // The peers with a receive posted for operation (context, seq).
  void peers_posted(std::uint32_t context, std::uint64_t seq, std::vector<int>& out) const;
  // The table, for listing its early messages; the receives waiting are take_posted_if's (the lone
  // one is not in it).
  const std::unordered_map<Key, Mailbox, KeyHash>& mailboxes() const noexcept { return mailboxes_; }
  void clear() noexcept {
    mailboxes_.clear();
    last_valid_ = false;
    lone_.op = nullptr;
    early_count_ = 0;
  }

 private:
  using Mailboxes = std::unordered_map<Key, Mailbox, KeyHash>;
  // A mailbox lives for about one message (keys carry per-peer counters): its map node and its queues'
  // storage are kept when it empties and given to the next key, instead of a node and a vector
  // allocated and freed per message (two of a small all_reduce's allocations, bench/RESULTS.md). 1,024
  // kept, not 16: a reader behind a broadcast's root holds a mailbox per message it has not reached.
  static constexpr std::size_t spare_mailboxes = 1024;
  Mailbox& mailbox(const Key& key) {
    if (auto it = find(key); it != mailboxes_.end()) return it->second;
    if (spare_nodes_.empty()) {
      last_ = mailboxes_.try_emplace(key).first;
    } else {
      Mailboxes::node_type node = std::move(spare_nodes_.back());
      spare_nodes_.pop_back();
      node.key() = key;
      last_ = mailboxes_.insert(std::move(node)).position;
    }
    last_valid_ = true;  // (an insert may rehash: the cached iterator is the one it returned)
    return last_->second;
  }
  // The mailbox of `key`, the last one found or made when it is that key's: a receive asks for its key
  // up to three times (recv_now, start_recv, the match), and a window of receives of one key asks for
  // the same every time, where each find hashes the key and divides by the bucket count.
  Mailboxes::iterator find(const Key& key) {
    if (last_valid_ && last_->first == key) return last_;
    const auto it = mailboxes_.find(key);
    if (it != mailboxes_.end()) {
      last_ = it;
      last_valid_ = true;
    }
    return it;
  }
  // The lone receive into the table, before anything is added to it (post, keep_early): the table then
  // holds every posted receive, and their order per key is kept (the lone one was posted first). The
  // sweeps take it where it is (take_posted_if).
  void spill() {
    if (lone_.op) mailbox(lone_.key).posted.push_back(std::exchange(lone_.op, nullptr));
  }
  void erase_if_empty(Mailboxes::iterator it) {
    if (!it->second.posted.empty() || !it->second.early.empty()) return;
    last_valid_ = false;
    if (spare_nodes_.size() < spare_mailboxes) {
      spare_nodes_.push_back(mailboxes_.extract(it));
    } else {
      mailboxes_.erase(it);
    }
  }

  std::size_t limit_ = std::size_t{4} << 30;
  std::size_t charged_ = 0;  // before every container of Earlies: their charges point here
  // Buffers for messages that arrive before their receive, reused: a pipelined collective produces many
  // of the same size, and fresh large allocations cost an mmap and page faults each.
  std::vector<Early> spare_buffers_;
  std::size_t spare_bytes_ = 0;
  std::vector<std::unique_ptr<std::byte[]>> spare_small_;  // small messages' buffers (matcher.cpp)
  Mailboxes mailboxes_;
  // Early messages in the table. A receive asks twice whether its message came early (recv_now's look,
  // then start_recv's); with none anywhere, the usual state while a window of receives is posted, neither
  // look finds, hashes or compares a key.
  std::size_t early_count_ = 0;
  std::vector<Mailboxes::node_type> spare_nodes_;  // emptied mailboxes, for the next keys
  // The one receive posted while no mailbox exists (a blocking receive, a ping-pong, a collective's round
  // of one peer: the usual state), kept beside the table while it is alone: posting and matching it is a
  // key compare, where the table's find, node insert and extract, and the key's hash for each, were
  // about 9 % of an 8-byte shm ping-pong's instructions (bench/RESULTS.md). Whenever `op` is set, the
  // table is empty; anything that adds to the table first moves it in (spill).
  struct Lone {
    Key key{};
    TransportOp* op = nullptr;
  };
  Lone lone_;
  // The mailbox found or made last (find): valid until a mailbox leaves the table or another is made.
  Mailboxes::iterator last_{};
  bool last_valid_ = false;
};

}  // namespace weft
