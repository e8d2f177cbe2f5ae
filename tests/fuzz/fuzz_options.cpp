// libFuzzer harness: every parser of environment and tuning strings. The input is split at '\n' into the
// values of weft's variables (and a WEFT_ALGO spec, which is also the tuning file's syntax); parsing must
// either succeed or throw weft::Error (invalid_argument) naming what is wrong; nothing else.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "algorithms/selection.hpp"
#include "weft/error.hpp"
#include "weft/options.hpp"

using namespace weft;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const char* const names[] = {"WEFT_RANK", "WEFT_WORLD_SIZE", "WEFT_STORE", "WEFT_BOOTSTRAP_TIMEOUT", "WEFT_SEGMENT_BYTES",
                                      "WEFT_PIPELINE_DEPTH", "WEFT_DETERMINISTIC", "WEFT_TRANSPORT", "WEFT_TIMEOUT", "WEFT_HEARTBEAT",
                                      "WEFT_MAX_EARLY_BYTES", "WEFT_JOB_ID", "WEFT_ALGO", "MASTER_ADDR", "MASTER_PORT", "RANK",
                                      "WORLD_SIZE", "SLURM_JOB_ID", "WEFT_SECRET"};
  constexpr std::size_t n = sizeof names / sizeof names[0];
  std::vector<std::string> values;
  std::string current;
  for (std::size_t i = 0; i < size; ++i) {
    if (data[i] == '\n') {
      values.push_back(current);
      current.clear();
    } else {
      current += static_cast<char>(data[i]);
    }
  }
  values.push_back(current);
  auto getenv = [&](const char* name) -> const char* {
    for (std::size_t i = 0; i < n && i < values.size(); ++i) {
      if (std::string(name) == names[i]) return values[i].empty() ? nullptr : values[i].c_str();
    }
    return nullptr;
  };
  auto expect_weft_error = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      if (e.errc() != Errc::invalid_argument) __builtin_trap();
    }
  };
  expect_weft_error([&] { Options{}.from_environment(getenv); });
  if (!values.empty()) expect_weft_error([&] { (void)parse_host_port(values[0], "fuzz"); });
  if (const char* spec = getenv("WEFT_ALGO")) {
    expect_weft_error([&] {
      algorithms::Selection selection;
      selection.override_with(spec, "WEFT_ALGO");
      (void)selection.choose("all_reduce", 1000, 4);
    });
  }
  return 0;
}
