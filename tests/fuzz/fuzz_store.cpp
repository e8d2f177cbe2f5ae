// libFuzzer harness: the rendezvous store's request handling (src/rendezvous/store.hpp). The input is a client's
// byte stream: requests are parsed and run against a table as the server would (WAIT's timeout and keys
// are parsed, not waited on). Nothing may crash or allocate beyond the request limits; a SET is seen by
// the GET after it.
#include <cstddef>
#include <cstdint>
#include <string>

#include "rendezvous/store.hpp"

using namespace weft;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  store::Table table;
  std::size_t at = 0;
  while (size - at >= store::request_header_size) {
    std::string error;
    const auto request = store::parse_request(reinterpret_cast<const std::byte*>(data + at), error);
    if (!request) {
      if (error.empty()) __builtin_trap();
      break;  // the server closes the connection here
    }
    at += store::request_header_size;
    if (request->key_bytes > store::max_key_bytes || request->value_bytes > store::max_value_bytes) __builtin_trap();
    if (size - at < request->key_bytes + request->value_bytes) break;  // the rest has not come
    std::string key(reinterpret_cast<const char*>(data + at), request->key_bytes);
    at += request->key_bytes;
    std::string value(reinterpret_cast<const char*>(data + at), request->value_bytes);
    at += request->value_bytes;
    if (request->command == store::Command::wait) {
      if (auto timeout = store::wait_timeout(value); timeout && timeout->count() > 86'400'000) __builtin_trap();
      (void)store::split_lines(key);
      continue;
    }
    const std::string kept = value;
    const auto reply = store::apply(table, request->command, key, std::move(value));
    if (request->command == store::Command::set) {
      const auto back = store::apply(table, store::Command::get, key, {});
      if (back.status != store::Status::ok || back.payload != kept) __builtin_trap();
    }
    if (request->command == store::Command::add && reply.status == store::Status::ok && reply.payload.size() != 8) __builtin_trap();
  }
  return 0;
}
