#include "algorithms/selection.hpp"

#include <algorithm>
#include <charconv>
#include <limits>

#include <fmt/format.h>

#include "weft/algorithms.hpp"
#include "weft/error.hpp"

namespace weft::algorithms {
namespace {

[[noreturn]] void bad(std::string_view source, std::string_view spec, const std::string& detail) {
  throw Error(Errc::invalid_argument, ErrorContext{.op = "configuration"},
              fmt::format("{}='{}': {}. Expected collective:algorithm[@LO-HI][,algorithm[@LO-HI]...][;...], "
                          "e.g. all_reduce:recursive_doubling@0-16K,ring",
                          source, spec, detail));
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  std::size_t start = 0;
  for (;;) {
    const auto at = s.find(sep, start);
    out.push_back(trim(s.substr(start, at == std::string_view::npos ? std::string_view::npos : at - start)));
    if (at == std::string_view::npos) break;
    start = at + 1;
  }
  return out;
}

bool parse_size(std::string_view text, std::size_t& out) {
  std::size_t value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr == text.data()) return false;
  std::string_view suffix(ptr, static_cast<std::size_t>(text.data() + text.size() - ptr));
  std::size_t scale = 1;
  if (suffix == "K" || suffix == "k") scale = std::size_t{1} << 10;
  else if (suffix == "M" || suffix == "m") scale = std::size_t{1} << 20;
  else if (suffix == "G" || suffix == "g") scale = std::size_t{1} << 30;
  else if (!suffix.empty()) return false;
  out = value * scale;
  return true;
}

}  // namespace

const std::vector<std::string_view>& available_algorithms(std::string_view collective) {
  static const std::vector<std::string_view> none;
  const auto c = collective_named(collective);
  return c ? names_for(*c) : none;
}

Selection::Selection() = default;

void Selection::override_with(std::string_view spec, std::string_view source) {
  if (trim(spec).empty()) return;
  for (std::string_view entry : split(spec, ';')) {
    if (entry.empty()) continue;
    const auto colon = entry.find(':');
    if (colon == std::string_view::npos) bad(source, spec, fmt::format("'{}' has no ':' after the collective", entry));
    const std::string_view collective = trim(entry.substr(0, colon));
    const auto known = collective_named(collective);
    if (!known || names_for(*known).empty()) {
      std::string names;
      for (Collective c : all_collectives) {
        if (!names_for(c).empty()) names += (names.empty() ? "" : ", ") + std::string(to_string(c));
      }
      bad(source, spec, fmt::format("unknown collective '{}' (known: {})", collective, names));
    }
    const auto& valid = names_for(*known);
    Entry parsed{*known, {}};
    for (std::string_view choice : split(entry.substr(colon + 1), ',')) {
      Choice c;
      const auto at = choice.find('@');
      const std::string_view name = trim(choice.substr(0, at));
      if (std::find(valid.begin(), valid.end(), name) == valid.end()) {
        std::string names;
        for (auto v : valid) names += (names.empty() ? "" : ", ") + std::string(v);
        bad(source, spec, fmt::format("'{}' is not an algorithm of {} (valid: {})", name, collective, names));
      }
      c.algorithm = find(*known, name);
      if (at != std::string_view::npos) {
        const std::string_view range = choice.substr(at + 1);
        const auto dash = range.find('-');
        if (dash == std::string_view::npos) bad(source, spec, fmt::format("range '{}' has no '-'", range));
        if (!parse_size(trim(range.substr(0, dash)), c.lo)) bad(source, spec, fmt::format("'{}' is not a size", range.substr(0, dash)));
        const std::string_view hi = trim(range.substr(dash + 1));
        if (!hi.empty() && !parse_size(hi, c.hi)) bad(source, spec, fmt::format("'{}' is not a size", hi));
        if (c.hi <= c.lo) bad(source, spec, fmt::format("range '{}' is empty", range));
      }
      parsed.choices.push_back(std::move(c));
    }
    std::erase_if(overrides_, [&](const Entry& e) { return e.collective == parsed.collective; });
    overrides_.push_back(std::move(parsed));
    ++version_;
  }
}

std::uint64_t Selection::digest() const noexcept {
  if (overrides_.empty()) return 0;
  std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the overrides, in the order applied
  const auto mix = [&h](std::uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ull;
    }
  };
  for (const Entry& entry : overrides_) {
    mix(static_cast<std::uint64_t>(entry.collective));
    for (const Choice& c : entry.choices) {
      for (char ch : c.algorithm->name) mix(static_cast<unsigned char>(ch));
      mix(c.lo);
      mix(c.hi);
    }
    mix(~std::uint64_t{0});
  }
  return h == 0 ? 1 : h;
}

const Algorithm* Selection::choose(Collective collective, std::size_t bytes, int ranks, Placement where) const {
  for (const auto& entry : overrides_) {
    if (entry.collective != collective) continue;
    for (const auto& c : entry.choices) {
      if (bytes >= c.lo && bytes < c.hi) return c.algorithm;
    }
  }
  return built_in(collective, bytes, ranks, where);
}

std::string_view Selection::choose(std::string_view collective, std::size_t bytes, int ranks, Placement where) const {
  const auto known = collective_named(collective);
  const Algorithm* chosen = known ? choose(*known, bytes, ranks, where) : nullptr;
  return chosen ? chosen->name : std::string_view();
}

namespace {

// Up to where the direct shm algorithm is the default on a group arena (exclusive): 128 KiB as measured
// first (the comment in built_in), further where measured since (bench/RESULTS.md, "The arena on a
// crowded host", "Copies into shared memory" and "The arena past 4 MiB": the arena forced against this
// table, taking turns, 2-3 rounds, on 2 cores; after the arena's copies were placed alike in their cache
// lines, 2026-12-01):
// - 2 ranks, a core each: all_gather 0.58-0.91 of the plans' time (out of place) and 0.45-0.68 (in
//   place) at 128 KiB-2 MiB (4 MiB level, 8-64 MiB mixed: 0.90-1.22 out of place); reduce_scatter
//   0.55-0.87 / 0.67-0.86 at 128 KiB-4 MiB and 0.32-0.79 at 8-64 MiB; broadcast 0.69-0.93 / 0.61-0.94
//   at 128 KiB-4 MiB and 0.84-1.08 (most below 1) at 8-64 MiB; all_to_all 0.41-0.87 / 0.53-0.73 to 1
//   MiB and, once the writer's own piece skipped its area, 0.80-0.96 / 0.47-0.50 at 2 MiB, 0.83-0.97 /
//   0.43-0.50 at 4 MiB, 0.74-1.09 / 0.33-0.38 at 8 MiB (16-64 MiB, before that: mixed out of place,
//   0.55-1.43, though 0.36-0.70 in place); all_reduce slower from 256 KiB (1.3-1.6x: the plans' rings
//   pipeline the reduction), so 128 KiB there; on the Intel Xeon of 2026-12-02, 7 rounds, the arena
//   took 0.64 of the table's time at 128 KiB (25.7 us against 40.3; Open MPI's vader 34.7) and 0.84
//   at 256 KiB, level or behind at 512 KiB-1 MiB: so through 128 KiB (below 256 KiB), where the EPYC
//   measured the two level.
// - More ranks than cores (`crowded`: every wait a wake-up or a yield), 3, 4 and 8 ranks: the arena's
//   few supersteps beat the plans' many rounds for every collective at every size measured, 256 KiB-4
//   MiB (all_reduce 0.68-0.90, all_gather at 4 MiB 0.40-0.70, reduce_scatter 0.46-0.73, broadcast
//   0.41-0.91, all_to_all 0.12-1.00, out of place; in place alike or better), 8-64 MiB (0.26-1.06,
//   in place 0.32-0.99, but for two of fifteen out-of-place all_to_all rounds of 8 MiB, 1.16 on 8
//   ranks and 1.64 on 3) and 256 MiB on 4 ranks (all_reduce 0.51, all_to_all 0.55), and level or
//   better at 128 KiB.
// More than 2 ranks each with a core of its own were not measured: 128 KiB there.
std::size_t arena_below(Collective collective, int ranks, Placement where) {
  constexpr std::size_t kib = 1024;
  constexpr std::size_t plain = 128 * kib;
  constexpr std::size_t every_size = std::numeric_limits<std::size_t>::max();
  if (where.crowded && ranks >= 3) return every_size;
  if (ranks != 2 || where.crowded) return plain;
  // Reading the peer's buffer directly, 2 ranks: all_gather and all_to_all at every size (the Intel Xeon
  // of 2026-12-02, direct against the table's rings: all_gather 4 MiB 442 us against 624, 16 MiB 1734
  // against 3049, 64 MiB level; all_to_all 16 MiB 1826 against 3022, 64 MiB 16825 against 19773). The
  // AMD EPYC of the same day was behind there (all_gather 1.37 and 1.05 of the rings' time at 16 and 64
  // MiB, all_to_all 1.01 and 1.16), by less than the Xeon gains: shm_collectives.cpp, reads_directly.
  if (where.direct_reads && (collective == Collective::all_gather || collective == Collective::all_to_all)) return every_size;
  switch (collective) {
    case Collective::all_gather: return 4096 * kib;
    case Collective::reduce_scatter:
    case Collective::broadcast: return every_size;
    case Collective::all_to_all: return 8192 * kib + 1;
    case Collective::all_reduce: return 256 * kib;
    default: return plain;
  }
}

}  // namespace

const Algorithm* Selection::built_in(Collective collective, std::size_t bytes, int ranks, Placement where) {
  // On a group arena the direct shm algorithms are the defaults below 128 KiB for the collectives that
  // have one (bench/RESULTS.md, "Direct shm collectives"): no frames, no matching, one copy in and the
  // reads straight from the areas; 2 ranks, all_reduce 16-64 KiB: 7-12 us against 12-19 us for the
  // best plan over the rings. From 128 KiB the plans over the rings win (128 KiB: 21-37 us on the
  // arena against 21-29; 256 KiB: 70-74 against 36-40): their copies pipeline, the arena's supersteps
  // (copy in, wait, read) do not.
  if (where.shared_arena && ranks > 1 &&
      (bytes < arena_below(collective, ranks, where) || collective == Collective::barrier)) {
    switch (collective) {
      case Collective::all_reduce:
      case Collective::all_gather:
      case Collective::reduce_scatter:
      case Collective::broadcast:
      case Collective::all_to_all:
      case Collective::barrier: return &entry(collective, Kind::shm);
      default: break;
    }
  }
  switch (collective) {
    case Collective::all_reduce:
      // From bench/algorithms.sh on this project's VMs (bench/RESULTS.md): recursive doubling while
      // latency dominates; on two ranks the bidirectional ring from 512 KiB (its two interleaved rings
      // keep a transfer going while the other reduces: 1.2-1.6x the ring at 1-4 MiB); on more,
      // Rabenseifner up to 4 MiB (it halves the rounds' data) and the ring beyond.
      if (ranks <= 1) return &entry(collective, Kind::ring);
      if (bytes < (std::size_t{64} << 10)) return &entry(collective, Kind::recursive_doubling);
      if (ranks == 2) {
        return &entry(collective, bytes < (std::size_t{512} << 10) ? Kind::recursive_doubling : Kind::bidirectional_ring);
      }
      // Across hosts the ring takes over from 256 KiB (bench/hosts.sh, links of 1 Gbit/s: 8 hosts, 256 KiB,
      // 0.123 GB/s busbw against Rabenseifner's 0.072; 4 hosts level): each of its steps keeps every link
      // busy with a p-th of the data, where Rabenseifner's first rounds send halves over one link each.
      if (where.across_hosts && bytes >= (std::size_t{256} << 10)) return &entry(collective, Kind::ring);
      return &entry(collective, bytes < (std::size_t{4} << 20) ? Kind::rabenseifner : Kind::ring);
    // Latency-bound sizes take the algorithms with the fewest rounds, bandwidth-bound ones those that
    // split the data (bench/RESULTS.md).
    // all_gather on one host takes Bruck up to 128 KiB (4 ranks on 2 cores, tcp, forced, 3 runs: 16 KiB
    // 39-58 us against the ring's 62-75, 64 KiB 42-75 against 65-80; 256 KiB mixed, 1 MiB the ring's);
    // across hosts, where that was not measured, up to 16 KiB as before.
    case Collective::all_gather: {
      const std::size_t bruck_below = where.across_hosts ? (std::size_t{16} << 10) : (std::size_t{128} << 10);
      return &entry(collective, bytes < bruck_below && ranks > 2 ? Kind::bruck : Kind::ring);
    }
    case Collective::reduce: {
      const bool split = ranks == 2 ? bytes >= (std::size_t{256} << 10) : bytes >= (std::size_t{8} << 20);
      return &entry(collective, split && ranks > 1 ? Kind::reduce_scatter_gather : Kind::binomial);
    }
    // reduce_scatter on a power of two: recursive halving (lg p rounds) below 512 KiB on one host (4
    // ranks on 2 cores, tcp, 3 interleaved runs: 64 KiB 40-42 us against the ring's 65-79, 256 KiB
    // 97-103 against 120-128, 512 KiB mixed, 1 MiB the ring's 300-316 against 455; 8 ranks: 128 KiB
    // 195-210 against 305-316), across hosts below 64 KiB as before (not measured there).
    case Collective::reduce_scatter: {
      const bool power_of_two = ranks > 2 && (ranks & (ranks - 1)) == 0;
      const std::size_t halving_below = where.across_hosts ? (std::size_t{64} << 10) : (std::size_t{512} << 10);
      return &entry(collective, power_of_two && bytes < halving_below ? Kind::recursive_halving : Kind::ring);
    }
    // The binomial tree won broadcast at every size measured on one host (but see the chain below), and
    // the pairwise exchange all_to_all (bruck stays selectable); gather and scatter go direct by default.
    // Across hosts, from 512 KiB on more than 2 ranks, scatter + all-gather: the binomial root sends the
    // whole buffer lg p times over its one link, the scatter and the ring send it about twice in all,
    // spread over every link (bench/hosts.sh, 4 hosts at 1 Gbit/s, 1-16 MiB: 0.076-0.080 GB/s against
    // 0.058-0.060).
    // On one host, 3 and 4 ranks, small broadcasts take the chain: back to back, the binomial root
    // makes lg p sends per broadcast, each a system call of about 4 us here, and paces them all; the
    // chain makes one per rank (4 ranks on 2 cores, tcp, 5 interleaved rounds, medians: 64 B 7.8 us
    // against 10.4, 1 KiB 8.9 against 10.2, 4 KiB 12.2 against 11.3; 3 ranks: 5.3-7.7 us against 8.2-12
    // up to 4 KiB, 10-10.8 against 11.4-18 at 16 KiB; 8 ranks level. bench/RESULTS.md, "Small messages
    // over TCP, third pass").
    case Collective::broadcast:
      if (where.across_hosts && ranks > 2 && bytes >= (std::size_t{512} << 10)) return &entry(collective, Kind::scatter_all_gather);
      if (!where.across_hosts && (ranks == 3 || ranks == 4) && bytes < (ranks == 3 ? std::size_t{32} << 10 : std::size_t{4} << 10)) {
        return &entry(collective, Kind::chain);
      }
      return &entry(collective, Kind::binomial);
    case Collective::gather: return &entry(collective, Kind::direct);
    case Collective::scatter: return &entry(collective, Kind::direct);
    case Collective::all_to_all: return &entry(collective, Kind::pairwise);
    case Collective::barrier: return &entry(collective, Kind::dissemination);
    case Collective::permute:
    case Collective::split: return nullptr;
    // all_gatherv: the fewest rounds (Bruck, over blocks padded to the largest; `bytes` is that padded
    // size) on more than 2 ranks below 256 KiB, the ring above (4 ranks on 2 cores, tcp: the ring's three
    // steps took 63-87 us at 32 B-32 KiB against Open MPI's 42-47, Bruck 32-40 us; at 256 KiB Bruck 98-101
    // us, the ring 108; from 512 KiB the ring wins. bench/RESULTS.md, "Variable-size collectives").
    case Collective::all_gatherv:
      return &entry(collective, bytes < (std::size_t{256} << 10) && ranks > 2 ? Kind::bruck : Kind::ring);
    case Collective::gatherv: return &entry(collective, Kind::direct);
    case Collective::scatterv: return &entry(collective, Kind::direct);
    case Collective::all_to_allv: return &entry(collective, Kind::pairwise);
    case Collective::reduce_scatterv: return &entry(collective, Kind::ring);
  }
  return nullptr;
}

}  // namespace weft::algorithms
