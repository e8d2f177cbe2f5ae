#include "transports/framed/matcher.hpp"

#include <algorithm>

namespace weft {
namespace {

// Bytes of early-message buffers kept for reuse (docs/DESIGN.md quotes it by name). When full, the
// oldest go first: sizes in use now stay, sizes of operations long past leave (the 100 000-collective
// soak's memory settles under it).
constexpr std::size_t early_buffer_pool_bytes = 32 << 20;
// Early messages of at most small_buffer_bytes get buffers of exactly that size, up to spare_small_buffers
// of them kept: a rank behind its senders (a broadcast's reader) takes one per message, where malloc
// and free were the largest costs of a small broadcast's reader (with the 1,024 mailbox nodes kept:
// 6,566 -> 6,179 instructions per broadcast, callgrind, bench/RESULTS.md "Plans of whole messages").
constexpr std::size_t small_buffer_bytes = 512;
constexpr std::size_t spare_small_buffers = 4096;

}  // namespace

// Each field by its own odd constant, then folded: keys differ in one counter at a time (seq per
// operation, tag per send) and the table's prime bucket count takes the rest. A chain of four
// hash_combine steps was most of the 25 instructions a key cost, several times per message.
std::size_t Matcher::KeyHash::operator()(const Key& k) const noexcept {
  std::uint64_t h = ((static_cast<std::uint64_t>(static_cast<std::uint32_t>(k.peer)) << 32) | k.key.context) * 0x9e3779b97f4a7c15ull;
  h ^= k.key.seq * 0xc2b2ae3d27d4eb4full;
  h ^= k.key.tag * 0x165667b19e3779f9ull;
  return static_cast<std::size_t>(h ^ (h >> 29));
}

Matcher::Early Matcher::take_buffer(std::size_t bytes) {
  if (bytes <= small_buffer_bytes) {
    if (spare_small_.empty()) return Early{std::make_unique_for_overwrite<std::byte[]>(small_buffer_bytes), bytes, small_buffer_bytes, {}, {}};
    Early found{std::move(spare_small_.back()), bytes, small_buffer_bytes, {}, {}};
    spare_small_.pop_back();
    return found;
  }
  for (auto it = spare_buffers_.begin(); it != spare_buffers_.end(); ++it) {
    if (it->capacity >= bytes && it->capacity <= 2 * bytes + 4096) {
      Early found = std::move(*it);
      spare_bytes_ -= found.capacity;
      spare_buffers_.erase(it);
      found.bytes = bytes;
      return found;
    }
  }
  return Early{std::make_unique_for_overwrite<std::byte[]>(bytes), bytes, bytes, {}, {}};
}

void Matcher::give_back(Early&& buffer) {
  buffer.charge.release();
  if (buffer.capacity == small_buffer_bytes && buffer.data) {
    if (spare_small_.size() < spare_small_buffers) spare_small_.push_back(std::move(buffer.data));
    return;
  }
  if (buffer.capacity < 4096 || buffer.capacity > early_buffer_pool_bytes) return;
  while (spare_bytes_ + buffer.capacity > early_buffer_pool_bytes && !spare_buffers_.empty()) {
    spare_bytes_ -= spare_buffers_.front().capacity;
    spare_buffers_.erase(spare_buffers_.begin());
  }
  spare_bytes_ += buffer.capacity;
  spare_buffers_.push_back(std::move(buffer));
}

std::optional<Matcher::Early> Matcher::take_early(const Key& key) {
  if (early_count_ == 0) return std::nullopt;  // the usual answer for a receive posted before its message
  auto it = find(key);
  if (it == mailboxes_.end() || it->second.early.empty()) return std::nullopt;
  Early message = std::move(it->second.early.front());
  it->second.early.pop_front();
  --early_count_;
  erase_if_empty(it);
  return message;
}

bool Matcher::withdraw(TransportOp& op) {
  if (lone_.op == &op) {
    lone_.op = nullptr;
    return true;
  }
  auto it = find(Key{op.peer, op.key});
  if (it == mailboxes_.end()) return false;
  auto& posted = it->second.posted;
  auto found = std::find(posted.begin(), posted.end(), &op);
  if (found == posted.end()) return false;
  posted.erase(found);
  erase_if_empty(it);
  return true;
}

void Matcher::forget_context(std::uint32_t context) {
  last_valid_ = false;
  std::erase_if(mailboxes_, [&](const auto& entry) {
    if (entry.first.key.context != context || !entry.second.posted.empty()) return false;
    early_count_ -= entry.second.early.size();
    return true;
  });
}

bool Matcher::any_posted() const noexcept {
  return lone_.op || std::any_of(mailboxes_.begin(), mailboxes_.end(), [](const auto& entry) { return !entry.second.posted.empty(); });
}

void Matcher::peers_posted(std::uint32_t context, std::uint64_t seq, std::vector<int>& out) const {
  if (lone_.op && lone_.key.key.context == context && lone_.key.key.seq == seq) out.push_back(lone_.key.peer);
  for (const auto& [key, mailbox] : mailboxes_) {
    if (key.key.context == context && key.key.seq == seq && !mailbox.posted.empty()) out.push_back(key.peer);
  }
}

}  // namespace weft
