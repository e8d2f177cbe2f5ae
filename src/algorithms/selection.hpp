#pragma once
// Which algorithm runs a collective: built-in defaults by (collective, bytes, ranks), overridden by
// Options::algorithms / WEFT_ALGO, e.g.
//   all_reduce:recursive_doubling@0-16K,rabenseifner@16K-1M,ring;broadcast:binomial
// A choice's range is [lo, hi) in bytes of the collective's buffer (K, M, G: powers of 1024); a choice
// without a range takes every size the earlier choices left. A malformed value is an error that says
// what was expected; nothing is silently ignored.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "algorithms/registry.hpp"

namespace weft::algorithms {

/// What the table knows of where a group's ranks are; the same on every rank of the group.
struct Placement {
  bool shared_arena = false;  // the group has a group arena (all its ranks on one host, over shm)
  bool across_hosts = false;  // some of its ranks are on other hosts (another boot or network namespace)
  // With an arena: its ranks outnumber the cores of their host (the host's online CPUs, the same count
  // for every rank of it), so that every wait for a peer is a wake-up or a yield.
  bool crowded = false;
  // With an arena: it reads the peers' buffers directly (single copy; transports/shm/arena.hpp, "Direct
  // reads"), the same choice on every rank.
  bool direct_reads = false;
};

class Selection {
 public:
  /// The built-in table (see selection.cpp for the measurements behind it).
  Selection();
  /// Overrides the collectives `spec` names. Errors: weft::Error (invalid_argument) naming `source`
  /// (e.g. "WEFT_ALGO") and what was expected.
  void override_with(std::string_view spec, std::string_view source);

  /// The algorithm for `collective` of `bytes` bytes on `ranks` ranks: an entry of the registry. A
  /// collective without a choice (permute, split) has none: null. `where`: with a group arena the direct
  /// shm algorithms are the defaults; across hosts the bandwidth-bound sizes take the algorithms that
  /// spread the data over the links.
  const Algorithm* choose(Collective collective, std::size_t bytes, int ranks, Placement where = {}) const;
  /// The same by names, for tools and tests: the algorithm's name, empty when `collective` names no
  /// collective with a choice.
  std::string_view choose(std::string_view collective, std::size_t bytes, int ranks, Placement where = {}) const;

  /// Counts the overrides applied so far: a caller that remembers a choice remembers this with it, and
  /// chooses again when it moved.
  std::uint64_t version() const noexcept { return version_; }
  /// The overrides as one number, 0 without any: every rank of a job must select alike (a rank that
  /// runs another algorithm than its peers waits for messages they never send), so the bootstrap
  /// refuses a rank whose digest (with the segment size's: group/create.cpp) differs.
  std::uint64_t digest() const noexcept;
  /// The built-in table alone (what choose() gives without overrides).
  static const Algorithm* built_in(Collective collective, std::size_t bytes, int ranks, Placement where = {});

 private:
  struct Choice {
    const Algorithm* algorithm = nullptr;
    std::size_t lo = 0;
    std::size_t hi = static_cast<std::size_t>(-1);
  };
  struct Entry {
    Collective collective;
    std::vector<Choice> choices;
  };
  std::vector<Entry> overrides_;
  std::uint64_t version_ = 0;
};

}  // namespace weft::algorithms
