#include "src/algorithms/selection.hpp"

#include <algorithm>
#include <charconv>
#include <map>

#include <fmt/format.h>

#include "weft/algorithms.hpp"
#include "weft/error.hpp"

namespace weft::algorithms {
namespace {

const std::map<std::string_view, std::vector<std::string_view>>& table() {
  static const std::map<std::string_view, std::vector<std::string_view>> known = {
      {"all_reduce", {"ring", "bidirectional_ring", "recursive_doubling", "rabenseifner", "tree"}},
      {"all_gather", {"ring", "bruck", "recursive_doubling"}},
      {"reduce_scatter", {"ring", "recursive_halving"}},
      {"broadcast", {"binomial", "scatter_all_gather"}},
      {"reduce", {"binomial", "reduce_scatter_gather"}},
      {"gather", {"direct", "binomial"}},
      {"scatter", {"direct", "binomial"}},
      {"all_to_all", {"pairwise", "bruck"}},
      {"barrier", {"dissemination"}},
  };
  return known;
}

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
  return algorithms_for(collective);
}

const std::vector<std::string_view>& algorithms_for(std::string_view collective) {
  static const std::vector<std::string_view> none;
  auto it = table().find(collective);
  return it == table().end() ? none : it->second;
}

Selection::Selection() = default;

void Selection::override_with(std::string_view spec, std::string_view source) {
  if (trim(spec).empty()) return;
  for (std::string_view entry : split(spec, ';')) {
    if (entry.empty()) continue;
    const auto colon = entry.find(':');
    if (colon == std::string_view::npos) bad(source, spec, fmt::format("'{}' has no ':' after the collective", entry));
    const std::string_view collective = trim(entry.substr(0, colon));
    const auto& valid = algorithms_for(collective);
    if (valid.empty()) {
      std::string names;
      for (const auto& [name, algos] : table()) names += (names.empty() ? "" : ", ") + std::string(name);
      bad(source, spec, fmt::format("unknown collective '{}' (known: {})", collective, names));
    }
    Entry parsed{std::string(collective), {}};
    for (std::string_view choice : split(entry.substr(colon + 1), ',')) {
      Choice c;
      const auto at = choice.find('@');
      const std::string_view name = trim(choice.substr(0, at));
      if (std::find(valid.begin(), valid.end(), name) == valid.end()) {
        std::string names;
        for (auto v : valid) names += (names.empty() ? "" : ", ") + std::string(v);
        bad(source, spec, fmt::format("'{}' is not an algorithm of {} (valid: {})", name, collective, names));
      }
      c.algorithm = std::string(name);
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
  }
}

std::string_view Selection::choose(std::string_view collective, std::size_t bytes, int ranks) const {
  for (const auto& entry : overrides_) {
    if (entry.collective != collective) continue;
    for (const auto& c : entry.choices) {
      if (bytes >= c.lo && bytes < c.hi) return c.algorithm;
    }
  }
  if (collective == "all_reduce") {
    // Built-in, from bench/algorithms.sh on this project's VMs (bench/RESULTS.md): recursive doubling
    // while latency dominates; on two ranks the bidirectional ring from 512 KiB (its two interleaved
    // rings keep a transfer going while the other reduces: 1.2-1.6x the ring at 1-4 MiB); on more,
    // Rabenseifner up to 4 MiB (it halves the rounds' data) and the ring beyond.
    if (ranks <= 1) return "ring";
    if (bytes < (std::size_t{64} << 10)) return "recursive_doubling";
    if (ranks == 2) return bytes < (std::size_t{512} << 10) ? "recursive_doubling" : "bidirectional_ring";
    return bytes < (std::size_t{4} << 20) ? "rabenseifner" : "ring";
  }
  // Latency-bound sizes take the algorithms with the fewest rounds, bandwidth-bound ones those that
  // split the data (bench/RESULTS.md).
  if (collective == "all_gather") return bytes < (std::size_t{16} << 10) && ranks > 2 ? "bruck" : "ring";
  if (collective == "reduce") {
    const bool split = ranks == 2 ? bytes >= (std::size_t{256} << 10) : bytes >= (std::size_t{8} << 20);
    return split && ranks > 1 ? "reduce_scatter_gather" : "binomial";
  }
  if (collective == "reduce_scatter") {
    const bool power_of_two = ranks > 2 && (ranks & (ranks - 1)) == 0;
    return power_of_two && bytes < (std::size_t{64} << 10) ? "recursive_halving" : "ring";
  }
  // broadcast: the binomial tree won at every size measured, and all_to_all's pairwise exchange too
  // (scatter_all_gather and bruck stay selectable).
  const auto& valid = algorithms_for(collective);
  return valid.empty() ? std::string_view{} : valid.front();
}

}  // namespace weft::algorithms
