#include "core/env.hpp"

#include <cstdlib>
#include <string_view>

#include <fmt/format.h>

#include "weft/error.hpp"

namespace weft::detail {

namespace {
[[noreturn]] void refuse(const char* name, std::string_view text, std::string_view expected) {
  throw Error(Errc::invalid_argument, ErrorContext{.op = "configuration"}, fmt::format("{}='{}' is not {}", name, text, expected));
}

// Digits only (no sign, no space), from `min` to `max`; `expected` says so in the refusal.
long long parse_whole(const char* name, const char* text, long long min, long long max, std::string_view expected) {
  const std::string_view digits(text);
  if (digits.empty()) refuse(name, digits, expected);
  long long value = 0;
  for (const char c : digits) {
    if (c < '0' || c > '9') refuse(name, digits, expected);
    value = value * 10 + (c - '0');
    if (value > max) refuse(name, digits, expected);  // before it could wrap
  }
  if (value < min) refuse(name, digits, expected);
  return value;
}
}  // namespace

bool parse_switch(const char* name, const char* text) {
  const std::string_view value(text);
  if (value == "0" || value == "1") return value == "1";
  refuse(name, value, "a switch (valid: 0, 1)");
}

bool env_switch(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  return parse_switch(name, v);
}

std::chrono::microseconds parse_microseconds(const char* name, const char* text, std::chrono::microseconds max) {
  return std::chrono::microseconds(
      parse_whole(name, text, 0, max.count(), fmt::format("a whole number of microseconds from 0 to {}", max.count())));
}

std::chrono::microseconds env_microseconds(const char* name, std::chrono::microseconds fallback, std::chrono::microseconds max) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  return parse_microseconds(name, v, max);
}

std::chrono::microseconds env_microseconds_or(const char* name, std::chrono::microseconds fallback,
                                              std::chrono::microseconds max) noexcept {
  try {
    return env_microseconds(name, fallback, max);
  } catch (...) {
    return fallback;
  }
}

long long parse_count(const char* name, const char* text, long long min, long long max) {
  return parse_whole(name, text, min, max, fmt::format("a whole number from {} to {}", min, max));
}

long long env_count(const char* name, long long fallback, long long min, long long max) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  return parse_count(name, v, min, max);
}

long long env_count_or(const char* name, long long fallback, long long min, long long max) noexcept {
  try {
    return env_count(name, fallback, min, max);
  } catch (...) {
    return fallback;
  }
}

}  // namespace weft::detail
