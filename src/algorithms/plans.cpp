#include <algorithm>

#include "weft/algorithms.hpp"

namespace weft::algorithms {
namespace {

int wrap(int x, int p) noexcept { return ((x % p) + p) % p; }

Step make_send(int to, Range range) { return Step{StepKind::send, to, -1, range, {}}; }

Step make_recv(StepKind kind, int from, Range range, int to = -1) {
  Step s{kind, to, from, {}, range};
  if (to >= 0) s.send = range;
  return s;
}

}  // namespace

std::string_view to_string(StepKind kind) noexcept {
  switch (kind) {
    case StepKind::send: return "send";
    case StepKind::recv: return "recv";
    case StepKind::recv_reduce: return "recv_reduce";
    case StepKind::recv_reduce_send: return "recv_reduce_send";
    case StepKind::recv_copy_send: return "recv_copy_send";
    case StepKind::send_recv: return "send_recv";
    case StepKind::send_recv_reduce: return "send_recv_reduce";
  }
  return "?";
}

Range block(std::size_t count, int parts, int i) noexcept {
  const auto n = static_cast<std::size_t>(parts);
  const auto k = static_cast<std::size_t>(i);
  const std::size_t base = count / n;
  const std::size_t extra = count % n;
  return Range{k * base + std::min(k, extra), base + (k < extra ? 1 : 0)};
}

std::vector<Range> blocks_of(std::size_t count, int parts) {
  std::vector<Range> blocks;
  for (int i = 0; i < parts; ++i) blocks.push_back(block(count, parts, i));
  return blocks;
}

// Rank r sends its starting block to the next rank; each later step receives the block the previous rank
// just finished, reduces it, and passes it on. After p-1 steps block (r + shift + 1) is complete here.
Plan ring_reduce_scatter(int p, int r, std::span<const Range> blocks, int shift) {
  Plan plan;
  if (p == 1) return plan;
  const int next = wrap(r + 1, p);
  const int prev = wrap(r - 1, p);
  plan.push_back(make_send(next, blocks[static_cast<std::size_t>(wrap(r + shift, p))]));
  for (int s = 1; s < p - 1; ++s) {
    plan.push_back(make_recv(StepKind::recv_reduce_send, prev, blocks[static_cast<std::size_t>(wrap(r + shift - s, p))], next));
  }
  plan.push_back(make_recv(StepKind::recv_reduce, prev, blocks[static_cast<std::size_t>(wrap(r + shift + 1, p))]));
  return plan;
}

Plan ring_all_gather(int p, int r, std::span<const Range> blocks, int shift) {
  Plan plan;
  if (p == 1) return plan;
  const int next = wrap(r + 1, p);
  const int prev = wrap(r - 1, p);
  plan.push_back(make_send(next, blocks[static_cast<std::size_t>(wrap(r + shift + 1, p))]));
  for (int s = 1; s < p - 1; ++s) {
    plan.push_back(make_recv(StepKind::recv_copy_send, prev, blocks[static_cast<std::size_t>(wrap(r + shift + 1 - s, p))], next));
  }
  plan.push_back(make_recv(StepKind::recv, prev, blocks[static_cast<std::size_t>(wrap(r + shift + 2, p))]));
  return plan;
}

// The reduce-scatter's last step forwards the finished block at once, which is the all-gather's first
// send: send, (p-1) x recv_reduce_send, (p-2) x recv_copy_send, recv.
Plan ring_all_reduce(int p, int r, std::size_t count) {
  Plan plan;
  if (p == 1) return plan;
  const std::vector<Range> blocks = blocks_of(count, p);
  const int next = wrap(r + 1, p);
  const int prev = wrap(r - 1, p);
  auto b = [&](int i) { return blocks[static_cast<std::size_t>(wrap(i, p))]; };
  plan.push_back(make_send(next, b(r)));
  for (int s = 1; s < p; ++s) plan.push_back(make_recv(StepKind::recv_reduce_send, prev, b(r - s), next));
  for (int s = 1; s < p - 1; ++s) plan.push_back(make_recv(StepKind::recv_copy_send, prev, b(r + 1 - s), next));
  plan.push_back(make_recv(StepKind::recv, prev, b(r + 2)));
  return plan;
}

// Two rings at once, each over half of the buffer: the lower half travels r -> r+1 (the ring above),
// the upper half r -> r-1 (the same ring with ranks mirrored, r' = -r mod p), so that every connection
// carries data both ways. The two scripts interleave step by step; their ranges never overlap, so the
// executor runs a step of each at the same time.
Plan bidirectional_ring_all_reduce(int p, int r, std::size_t count) {
  if (p == 1) return {};
  const std::size_t low = count / 2;
  const Plan forward = ring_all_reduce(p, r, low);
  Plan backward = ring_all_reduce(p, wrap(-r, p), count - low);
  for (Step& step : backward) {
    if (step.send_to >= 0) step.send_to = wrap(-step.send_to, p);
    if (step.recv_from >= 0) step.recv_from = wrap(-step.recv_from, p);
    step.send.offset += low;
    step.recv.offset += low;
  }
  Plan plan;
  for (std::size_t i = 0; i < forward.size(); ++i) {
    plan.push_back(forward[i]);
    plan.push_back(backward[i]);
  }
  return plan;
}

namespace {

// The fold that lets power-of-two algorithms run on any p: of the first 2*rem ranks (rem = p - 2^k), each
// even one hands its data to the odd one above it and waits; the others take part under a new rank.
struct Fold {
  int pof2 = 1;
  int rem = 0;
  int new_rank = -1;  // -1: this rank sits out (an even rank among the first 2*rem)
  int real(int new_r) const { return new_r < rem ? new_r * 2 + 1 : new_r + rem; }
};

Fold fold_for(int p, int r) {
  Fold f;
  while (f.pof2 * 2 <= p) f.pof2 *= 2;
  f.rem = p - f.pof2;
  if (r < 2 * f.rem) {
    f.new_rank = (r % 2 == 1) ? r / 2 : -1;
  } else {
    f.new_rank = r - f.rem;
  }
  return f;
}

void fold_in(Plan& plan, const Fold& f, int r, Range all) {
  if (r >= 2 * f.rem) return;
  if (r % 2 == 0) {
    plan.push_back(make_send(r + 1, all));
  } else {
    plan.push_back(make_recv(StepKind::recv_reduce, r - 1, all));
  }
}

void fold_out(Plan& plan, const Fold& f, int r, Range all) {
  if (r >= 2 * f.rem) return;
  if (r % 2 == 0) {
    plan.push_back(make_recv(StepKind::recv, r + 1, all));
  } else {
    plan.push_back(make_send(r - 1, all));
  }
}

// Elements of blocks [first, last) when `count` elements are cut into `parts` blocks.
Range blocks(std::size_t count, int parts, int first, int last) {
  const Range a = block(count, parts, first);
  if (last <= first) return Range{a.offset, 0};
  const Range b = block(count, parts, last - 1);
  return Range{a.offset, b.offset + b.count - a.offset};
}

// A power-of-two all-reduce on any p: fold in, run `body` on the ranks that take part, fold out.
template <class Body>
Plan with_fold(int p, int r, std::size_t count, Body body) {
  Plan plan;
  const Range all{0, count};
  const Fold f = fold_for(p, r);
  fold_in(plan, f, r, all);
  if (f.new_rank >= 0) body(plan, f);
  fold_out(plan, f, r, all);
  return plan;
}

}  // namespace

Plan recursive_doubling_all_reduce(int p, int r, std::size_t count) {
  return with_fold(p, r, count, [&](Plan& plan, const Fold& f) {
    const Range all{0, count};
    for (int mask = 1; mask < f.pof2; mask <<= 1) {
      const int partner = f.real(f.new_rank ^ mask);
      plan.push_back(Step{StepKind::send_recv_reduce, partner, partner, all, all});
    }
  });
}

Plan rabenseifner_all_reduce(int p, int r, std::size_t count) {
  return with_fold(p, r, count, [&](Plan& plan, const Fold& f) {
    const int nr = f.new_rank;
    // Recursive halving: each round keeps the half of the current blocks that holds block nr.
    int lo = 0;
    int hi = f.pof2;
    for (int mask = f.pof2 / 2; mask > 0; mask >>= 1) {
      const int partner = f.real(nr ^ mask);
      const int mid = lo + (hi - lo) / 2;
      const bool upper = (nr & mask) != 0;
      const Range keep = upper ? blocks(count, f.pof2, mid, hi) : blocks(count, f.pof2, lo, mid);
      const Range give = upper ? blocks(count, f.pof2, lo, mid) : blocks(count, f.pof2, mid, hi);
      plan.push_back(Step{StepKind::send_recv_reduce, partner, partner, give, keep});
      if (upper) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    // Recursive doubling all-gather: exchange what each holds, doubling it every round.
    for (int mask = 1; mask < f.pof2; mask <<= 1) {
      const int partner_new = nr ^ mask;
      const int mine = nr & ~(mask - 1);
      const int theirs = partner_new & ~(mask - 1);
      plan.push_back(Step{StepKind::send_recv, f.real(partner_new), f.real(partner_new),
                          blocks(count, f.pof2, mine, mine + mask), blocks(count, f.pof2, theirs, theirs + mask)});
    }
  });
}

Plan ordered_exchange(int p, int r, std::span<const Range> blocks) {
  Plan plan;
  const std::size_t slot = blocks[static_cast<std::size_t>(r)].count;
  for (int k = 1; k < p; ++k) {
    const int to = wrap(r + k, p);
    const int from = wrap(r - k, p);
    plan.push_back(Step{StepKind::send_recv, to, from, blocks[static_cast<std::size_t>(to)],
                        Range{static_cast<std::size_t>(from) * slot, slot}});
  }
  return plan;
}

Plan bruck_all_gather(int p, int r, std::size_t count) {
  Plan plan;
  for (int dist = 1; dist < p; dist <<= 1) {
    const auto blocks_now = static_cast<std::size_t>(std::min(dist, p - dist));
    plan.push_back(Step{StepKind::send_recv, wrap(r - dist, p), wrap(r + dist, p), Range{0, blocks_now * count},
                        Range{static_cast<std::size_t>(dist) * count, blocks_now * count}});
  }
  return plan;
}

Plan scatter_all_gather_broadcast(int p, int r, int root, std::size_t count) {
  Plan plan;
  if (p == 1) return plan;
  const std::vector<Range> parts = blocks_of(count, p);
  if (r == root) {
    for (int i = 0; i < p; ++i) {
      if (i != root) plan.push_back(make_send(i, parts[static_cast<std::size_t>(i)]));
    }
  } else {
    plan.push_back(make_recv(StepKind::recv, root, parts[static_cast<std::size_t>(r)]));
  }
  const Plan gather = ring_all_gather(p, r, parts, -1);
  plan.insert(plan.end(), gather.begin(), gather.end());
  return plan;
}

Plan reduce_scatter_gather_reduce(int p, int r, int root, std::size_t count) {
  Plan plan;
  if (p == 1) return plan;
  const std::vector<Range> parts = blocks_of(count, p);
  plan = ring_reduce_scatter(p, r, parts, -1);
  if (r == root) {
    for (int i = 0; i < p; ++i) {
      if (i != root) plan.push_back(make_recv(StepKind::recv, i, parts[static_cast<std::size_t>(i)]));
    }
  } else {
    plan.push_back(make_send(root, parts[static_cast<std::size_t>(r)]));
  }
  return plan;
}

Plan bruck_all_to_all(int p, int r, std::size_t count) {
  Plan plan;
  for (int dist = 1; dist < p; dist <<= 1) {
    const int to = wrap(r + dist, p);
    const int from = wrap(r - dist, p);
    // The slots with bit `dist` set come in runs of `dist` consecutive slots.
    for (int first = dist; first < p; first += 2 * dist) {
      const int last = std::min(first + dist, p);
      const Range run{static_cast<std::size_t>(first) * count, static_cast<std::size_t>(last - first) * count};
      plan.push_back(Step{StepKind::send_recv, to, from, run, run});
    }
  }
  return plan;
}

Plan recursive_halving_reduce_scatter(int p, int r, std::size_t count) {
  Plan plan;
  if ((p & (p - 1)) != 0) return plan;  // powers of two only: the Group falls back to the ring
  int lo = 0;
  int hi = p;
  for (int mask = p / 2; mask > 0; mask >>= 1) {
    const int partner = r ^ mask;
    const int mid = lo + (hi - lo) / 2;
    const bool upper = (r & mask) != 0;
    const Range low{static_cast<std::size_t>(lo) * count, static_cast<std::size_t>(mid - lo) * count};
    const Range high{static_cast<std::size_t>(mid) * count, static_cast<std::size_t>(hi - mid) * count};
    plan.push_back(Step{StepKind::send_recv_reduce, partner, partner, upper ? low : high, upper ? high : low});
    if (upper) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return plan;
}

Plan tree_all_reduce(int p, int r, std::size_t count) {
  Plan plan = binomial_reduce(p, r, 0, count);
  const Plan down = binomial_broadcast(p, r, 0, count);
  plan.insert(plan.end(), down.begin(), down.end());
  return plan;
}

Plan binomial_broadcast(int p, int r, int root, std::size_t count) {
  Plan plan;
  const Range all{0, count};
  const int vr = wrap(r - root, p);
  int mask = 1;
  while (mask < p) {
    if (vr & mask) {
      plan.push_back(make_recv(StepKind::recv, wrap(vr - mask + root, p), all));
      break;
    }
    mask <<= 1;
  }
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (vr + mask < p) plan.push_back(make_send(wrap(vr + mask + root, p), all));
  }
  return plan;
}

Plan chain_broadcast(int p, int r, int root, std::size_t count) {
  Plan plan;
  if (p == 1) return plan;
  const Range all{0, count};
  const int vr = wrap(r - root, p);
  const int next = wrap(r + 1, p);
  const int prev = wrap(r - 1, p);
  if (vr == 0) {
    plan.push_back(make_send(next, all));
  } else if (vr == p - 1) {
    plan.push_back(make_recv(StepKind::recv, prev, all));
  } else {
    plan.push_back(make_recv(StepKind::recv_copy_send, prev, all, next));
  }
  return plan;
}

Plan binomial_reduce(int p, int r, int root, std::size_t count) {
  Plan plan;
  const Range all{0, count};
  const int vr = wrap(r - root, p);
  for (int mask = 1; mask < p; mask <<= 1) {
    if ((vr & mask) == 0) {
      if ((vr | mask) < p) plan.push_back(make_recv(StepKind::recv_reduce, wrap((vr | mask) + root, p), all));
    } else {
      // Forwarding reads the accumulator: send from the receive buffer.
      Step up = make_send(wrap((vr & ~mask) + root, p), all);
      up.kind = StepKind::send;
      plan.push_back(up);
      break;
    }
  }
  return plan;
}

namespace {
// count elements per rank, block i at i * count: the equal-block layout of gather, scatter and all_to_all.
std::vector<Range> equal_blocks(int p, std::size_t count) {
  std::vector<Range> blocks(static_cast<std::size_t>(p));
  for (int i = 0; i < p; ++i) blocks[static_cast<std::size_t>(i)] = Range{static_cast<std::size_t>(i) * count, count};
  return blocks;
}
}  // namespace

Plan direct_gather(int p, int r, int root, std::span<const Range> blocks) {
  Plan plan;
  if (r == root) {
    for (int i = 0; i < p; ++i) {
      if (i != root) plan.push_back(make_recv(StepKind::recv, i, blocks[static_cast<std::size_t>(i)]));
    }
  } else {
    plan.push_back(make_send(root, Range{0, blocks[static_cast<std::size_t>(r)].count}));
  }
  return plan;
}

Plan direct_gather(int p, int r, int root, std::size_t count) { return direct_gather(p, r, root, equal_blocks(p, count)); }

Plan direct_scatter(int p, int r, int root, std::span<const Range> blocks) {
  Plan plan;
  if (r == root) {
    for (int i = 0; i < p; ++i) {
      if (i != root) plan.push_back(make_send(i, blocks[static_cast<std::size_t>(i)]));
    }
  } else {
    plan.push_back(make_recv(StepKind::recv, root, Range{0, blocks[static_cast<std::size_t>(r)].count}));
  }
  return plan;
}

Plan direct_scatter(int p, int r, int root, std::size_t count) { return direct_scatter(p, r, root, equal_blocks(p, count)); }

Plan recursive_doubling_all_gather(int p, int r, std::size_t count) {
  Plan plan;
  if ((p & (p - 1)) != 0) return plan;  // powers of two only: the Group falls back to Bruck
  for (int mask = 1; mask < p; mask <<= 1) {
    const int partner = r ^ mask;
    // Each rank holds the aligned run of `mask` blocks around it and swaps it for its partner's.
    const auto mine = static_cast<std::size_t>(r & ~(mask - 1));
    const auto theirs = static_cast<std::size_t>(partner & ~(mask - 1));
    const auto n = static_cast<std::size_t>(mask) * count;
    plan.push_back(Step{StepKind::send_recv, partner, partner, Range{mine * count, n}, Range{theirs * count, n}});
  }
  return plan;
}

namespace {
// The subtree of virtual rank v in a binomial tree of p ranks: v and the ranks below it, [v, v + size).
int subtree_size(int v, int p) {
  int mask = 1;
  while (mask < p && (v & mask) == 0) mask <<= 1;
  return std::min(mask, p - v);
}
}  // namespace

// Virtual ranks v = r - root; every rank's buffer holds its subtree's blocks in virtual order from slot 0.
// A child's subtree arrives in one message: lg p rounds, every block moving up once per level.
Plan binomial_gather(int p, int r, int root, std::size_t count) {
  Plan plan;
  const int v = wrap(r - root, p);
  for (int mask = 1; mask < p; mask <<= 1) {
    if (v & mask) {
      plan.push_back(make_send(wrap(v - mask + root, p), Range{0, static_cast<std::size_t>(subtree_size(v, p)) * count}));
      break;
    }
    if (v + mask < p) {
      const auto child_blocks = static_cast<std::size_t>(subtree_size(v + mask, p));
      plan.push_back(make_recv(StepKind::recv, wrap(v + mask + root, p),
                               Range{static_cast<std::size_t>(mask) * count, child_blocks * count}));
    }
  }
  return plan;
}

// The gather reversed: the root's buffer holds all blocks in virtual order; each rank receives its
// subtree's blocks from its parent and passes on each child's part, largest child first.
Plan binomial_scatter(int p, int r, int root, std::size_t count) {
  Plan plan;
  const int v = wrap(r - root, p);
  int mask = 1;
  while (mask < p && (v & mask) == 0) mask <<= 1;
  if (v != 0) {
    plan.push_back(make_recv(StepKind::recv, wrap(v - mask + root, p), Range{0, static_cast<std::size_t>(subtree_size(v, p)) * count}));
  }
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (v + mask < p) {
      const auto child_blocks = static_cast<std::size_t>(subtree_size(v + mask, p));
      plan.push_back(make_send(wrap(v + mask + root, p), Range{static_cast<std::size_t>(mask) * count, child_blocks * count}));
    }
  }
  return plan;
}

Plan pairwise_all_to_all(int p, int r, std::span<const Range> sends, std::span<const Range> recvs) {
  Plan plan;
  for (int k = 1; k < p; ++k) {
    const int to = wrap(r + k, p);
    const int from = wrap(r - k, p);
    plan.push_back(Step{StepKind::send_recv, to, from, sends[static_cast<std::size_t>(to)], recvs[static_cast<std::size_t>(from)]});
  }
  return plan;
}

Plan pairwise_all_to_all(int p, int r, std::size_t count) {
  const auto blocks = equal_blocks(p, count);
  return pairwise_all_to_all(p, r, blocks, blocks);
}

Plan dissemination_barrier(int p, int r) {
  Plan plan;
  for (int k = 1; k < p; k <<= 1) {
    plan.push_back(Step{StepKind::send_recv, wrap(r + k, p), wrap(r - k, p), Range{}, Range{}});
  }
  return plan;
}

}  // namespace weft::algorithms
