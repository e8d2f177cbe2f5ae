// libFuzzer harness: the greeting that opens every connection (src/rendezvous/greeting.hpp). Decoding any
// bytes must not crash; a hello or details that decode must encode back to the same bytes (the reserved
// bytes aside); a verdict's reason length must be bounded; a refusal must say why.
#include <cstddef>
#include <cstdint>
#include <string>

#include "rendezvous/greeting.hpp"

using namespace weft;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  std::string error;
  if (size >= greeting::verdict_header_size) {
    if (auto n = greeting::reason_length(bytes, error); n && *n > greeting::max_reason_bytes) __builtin_trap();
  }
  if (size >= greeting::hello_size) {
    error.clear();
    if (auto h = greeting::decode_hello(bytes, error)) {
      const auto again = greeting::encode(*h);
      for (std::size_t i = 0; i < greeting::hello_size; ++i) {
        if (again[i] != bytes[i]) __builtin_trap();
      }
    } else if (error.empty()) {
      __builtin_trap();
    }
  }
  error.clear();
  if (auto d = greeting::decode_details(bytes, size, error)) {
    if (d->job.size() > greeting::max_job_bytes) __builtin_trap();
    const auto again = greeting::encode(*d);
    if (again.size() != size) __builtin_trap();
    for (std::size_t i = 0; i < size; ++i) {
      if (i == 11) continue;  // reserved: not decoded, written as zero
      if (again[i] != bytes[i]) __builtin_trap();
    }
  } else if (error.empty()) {
    __builtin_trap();  // a refusal must say why
  }
  return 0;
}
