#include "transports/shm/arena.hpp"

#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "transports/shm/ring.hpp"
#include "core/weak_poller.hpp"

namespace weft::shm {
namespace {

constexpr std::size_t round_up(std::size_t n, std::size_t to) noexcept { return (n + to - 1) / to * to; }

std::size_t controls_offset() noexcept { return round_up(sizeof(ArenaHeader), 64); }
std::size_t areas_offset(int ranks) noexcept {
  return round_up(controls_offset() + sizeof(RankControl) * static_cast<std::size_t>(ranks), 4096);
}
// An area: its header's line, then its bytes (contents below placed_from right after the header:
// arena.hpp), which may start up to 63 bytes into their first line (the skew): 128, not 64, before the bytes.
std::size_t stride_of(std::size_t area_bytes) noexcept { return round_up(128 + area_bytes, 4096); }
std::size_t boxes_offset(int ranks, std::size_t area_bytes) noexcept {
  return areas_offset(ranks) + 2 * static_cast<std::size_t>(ranks) * stride_of(area_bytes);
}
std::size_t segment_bytes(int ranks, std::size_t area_bytes) noexcept {
  return boxes_offset(ranks, area_bytes) + static_cast<std::size_t>(ranks) * Arena::box_slots * Arena::box_slot_bytes;
}

}  // namespace

std::size_t Arena::area_bytes_for(int ranks) noexcept {
  if (ranks <= 16) return std::size_t{1} << 20;
  return std::max<std::size_t>(std::size_t{64} << 10, (std::size_t{16} << 20) / static_cast<std::size_t>(ranks) & ~std::size_t{4095});
}

Arena::Arena(Segment segment, int ranks, int rank, std::size_t area_bytes)
    : segment_(std::move(segment)), ranks_(ranks), rank_(rank) {
  auto* base = static_cast<std::byte*>(segment_.data());
  area_bytes_ = area_bytes;
  area_stride_ = stride_of(area_bytes_);
  controls_ = reinterpret_cast<RankControl*>(base + controls_offset());
  areas_ = base + areas_offset(ranks);
  boxes_ = base + boxes_offset(ranks, area_bytes_);
}

std::shared_ptr<Arena> Arena::create(int ranks, int rank) {
  const std::size_t area = area_bytes_for(ranks);
  Segment segment = Segment::create(segment_bytes(ranks, area), "weft-arena");
  auto* base = static_cast<std::byte*>(segment.data());
  new (base) ArenaHeader{arena_magic, arena_version, static_cast<std::uint32_t>(ranks), area};
  for (int r = 0; r < ranks; ++r) new (base + controls_offset() + sizeof(RankControl) * static_cast<std::size_t>(r)) RankControl{};
  auto arena = std::shared_ptr<Arena>(new Arena(std::move(segment), ranks, rank, area));
  for (int r = 0; r < ranks; ++r) {
    for (std::uint64_t parity = 0; parity < 2; ++parity) new (&arena->header_at(r, parity)) AreaHeader{};
    for (std::uint64_t slot = 0; slot < box_slots; ++slot) {
      new (arena->boxes_ + (static_cast<std::size_t>(r) * box_slots + slot) * box_slot_bytes) AreaHeader{};
    }
  }
  return arena;
}

std::shared_ptr<Arena> Arena::adopt(int fd, int ranks, int rank) {
  Segment segment = Segment::adopt(fd, controls_offset());
  const auto* header = static_cast<const ArenaHeader*>(segment.data());
  if (header->magic != arena_magic || header->version != arena_version) {
    throw std::runtime_error("the group arena is not one (wrong magic or version)");
  }
  if (header->ranks != static_cast<std::uint32_t>(ranks)) {
    throw std::runtime_error("the group arena is for " + std::to_string(header->ranks) + " ranks, not " + std::to_string(ranks));
  }
  // Read once: the header is in memory every member can write, so what was checked is what is used.
  const std::uint64_t area_bytes = __atomic_load_n(&header->area_bytes, __ATOMIC_RELAXED);
  if (area_bytes == 0 || area_bytes > (std::uint64_t{1} << 30) || segment.size() < segment_bytes(ranks, static_cast<std::size_t>(area_bytes))) {
    throw std::runtime_error("the group arena is smaller than its header says");
  }
  return std::shared_ptr<Arena>(new Arena(std::move(segment), ranks, rank, static_cast<std::size_t>(area_bytes)));
}

Arena::~Arena() {
  if (loop_ && loop_alive_->load(std::memory_order_acquire)) loop_->remove_poller(poller_);
  for (int fd : wake_fds_) {
    if (fd >= 0) ::close(fd);
  }
}

void Arena::attach(Loop& loop, std::vector<int> wake_fds) {
  loop_ = &loop;
  loop_alive_ = loop.alive_word();
  wake_fds_ = std::move(wake_fds);
  // A loop with a thread of its own arms before every sleep, so it starts awake; a borrowed io_context
  // never polls nor arms (Loop::Poller), so it stays armed and is woken on every step.
  control(rank_).sleeping.store(loop.owns_thread() ? 0 : 1, std::memory_order_release);
  poller_ = loop.add_poller(std::make_shared<detail::WeakPoller<Arena>>(weak_from_this()));
}


void Arena::publish() noexcept {
  header_at(rank_, count_ & 1).set_skew(next_skew_);  // with the header, before the count that shows it
  next_skew_ = 0;
  ++count_;
  store_and_fence(header_at(rank_, (count_ - 1) & 1).published, count_, std::memory_order_release);
  wake_sleepers();
}

void Arena::stamp_slot() noexcept {
  store_and_fence(slot_header(rank_).published, box_count_ + 1, std::memory_order_release);
  wake_sleepers();
  // The line this root writes at its next box broadcast, asked for now, while the readers take this one:
  // a root that publishes into a line a caught-up reader is polling waits at the fence above for the
  // line to come over; one that finds it here already goes on, runs ahead, and the readers stop polling
  // the lines it is about to write. 2 ranks, 8-32 B: 0.24-0.30 -> 0.13-0.16 us a broadcast (bench/RESULTS.md, "A
  // root's next slot asked for early"). Only for contents on the header's line (the next call is taken
  // to be like this one): asking for more lines, or for the superstep areas' next header, made 64 B
  // broadcasts and small all_reduces slower (the readers' polls take them back).
  if (box_bytes_ <= bytes_beside_header) prefetch_for_writing(slot_at(rank_, box_taking_));
}

void Arena::write_box(const void* from, std::size_t bytes) const noexcept {
  if (bytes <= slot_contents) {  // the common case: one copy (none for nothing: `from` may be null)
    if (bytes > 0) std::memcpy(slot_at(rank_, 0) + sizeof(AreaHeader), from, bytes);
    return;
  }
  const auto* at = static_cast<const std::byte*>(from);
  for (std::uint64_t k = 0; k * slot_contents < bytes; ++k) {
    std::memcpy(slot_at(rank_, k) + sizeof(AreaHeader), at + k * slot_contents, std::min(slot_contents, bytes - k * slot_contents));
  }
}

void Arena::read_box(int r, void* to, std::size_t bytes) const noexcept {
  if (bytes <= slot_contents) {
    if (bytes > 0) std::memcpy(to, slot_at(r, 0) + sizeof(AreaHeader), bytes);
    return;
  }
  auto* at = static_cast<std::byte*>(to);
  for (std::uint64_t k = 0; k * slot_contents < bytes; ++k) {
    std::memcpy(at + k * slot_contents, slot_at(r, k) + sizeof(AreaHeader), std::min(slot_contents, bytes - k * slot_contents));
  }
}

void Arena::finish_box() noexcept {
  box_count_ += box_taking_;
  store_and_fence(control(rank_).box_done, box_count_, std::memory_order_release);
  wake_sleepers();
}

void Arena::wake_sleepers() noexcept {
  for (int r = 0; r < ranks_; ++r) {
    if (r == rank_ || control(r).sleeping.load(std::memory_order_relaxed) == 0) continue;
    const std::uint64_t one = 1;
    if (static_cast<std::size_t>(r) < wake_fds_.size() && wake_fds_[static_cast<std::size_t>(r)] >= 0) {
      [[maybe_unused]] const auto n = ::write(wake_fds_[static_cast<std::size_t>(r)], &one, sizeof one);
    }
  }
}



void Arena::offer_direct_reads(std::uint64_t from_bytes, std::vector<int> pids) noexcept {
  pids_ = std::move(pids);
  pids_.resize(static_cast<std::size_t>(ranks_), 0);
  bool every_peer = true;
  for (int r = 0; r < ranks_; ++r) every_peer = every_peer && (r == rank_ || pids_[static_cast<std::size_t>(r)] > 0);
  control(rank_).reads_from.store(every_peer ? from_bytes : 0, std::memory_order_release);
}

void Arena::settle_direct_reads() noexcept {
  std::uint64_t most = 0;
  for (int r = 0; r < ranks_; ++r) {
    const std::uint64_t theirs = control(r).reads_from.load(std::memory_order_acquire);
    if (theirs == 0) {
      direct_from_ = 0;
      return;
    }
    most = std::max(most, theirs);
  }
  direct_from_ = most;
}

int Arena::read_direct(int r, std::uint64_t address, void* to, std::size_t bytes) const noexcept {
  auto* at = static_cast<std::byte*>(to);
  while (bytes > 0) {
    iovec local{at, bytes};
    iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(address)), bytes};
    const ssize_t n = ::process_vm_readv(pids_[static_cast<std::size_t>(r)], &local, 1, &remote, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EIO;
    at += n;
    address += static_cast<std::uint64_t>(n);
    bytes -= static_cast<std::size_t>(n);
  }
  return 0;
}

void Arena::revoke(std::uint64_t seq) noexcept { store_and_fence(control(rank_).revoked, seq, std::memory_order_release); }

std::vector<int> Arena::behind() const {
  std::vector<int> out;
  for (int r = 0; r < ranks_; ++r) {
    if (waits_on(r)) out.push_back(r);
  }
  return out;
}

std::size_t Arena::poll() {
  if (!waiter_ || !ready_or_interrupted()) return 0;
  auto handle = std::exchange(waiter_, nullptr)->handle;
  handle.resume();
  return 1;
}

bool Arena::arm() {
  if (!waiter_) return false;  // nothing to wait for: nobody needs to wake this rank
  store_and_fence(control(rank_).sleeping, std::uint32_t{1}, std::memory_order_relaxed);
  return ready_or_interrupted();
}

void Arena::disarm() { control(rank_).sleeping.store(0, std::memory_order_relaxed); }

}  // namespace weft::shm
