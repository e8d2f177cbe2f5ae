#include "core/env.hpp"

#include <cstdlib>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "weft/error.hpp"
#include "weft/options.hpp"

namespace weft::detail {

namespace {
[[noreturn]] void bad(const std::string& detail) {
  throw Error(Errc::invalid_argument, ErrorContext{.op = "configuration"}, detail);
}

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

long long parse_count(const char* name, const char* text, long long min, long long max, std::string_view words) {
  return parse_whole(name, text, min, max, fmt::format("{} or a whole number from {} to {}", words, min, max));
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

// A duration: a number with a unit (ms, s, m, h; none: seconds), e.g. "500ms", "30s", "2m", "45".
std::chrono::milliseconds parse_duration(const char* name, const char* text) {
  const std::string_view t(text);
  std::size_t digits = 0;
  while (digits < t.size() && t[digits] >= '0' && t[digits] <= '9') ++digits;
  const std::string_view unit = t.substr(digits);
  long long scale = 0;
  if (unit.empty() || unit == "s") scale = 1000;
  else if (unit == "ms") scale = 1;
  else if (unit == "m") scale = 60'000;
  else if (unit == "h") scale = 3'600'000;
  if (digits == 0 || digits > 12 || scale == 0) {
    bad(fmt::format("{}='{}' is not a duration (a whole number with ms, s, m or h; no unit: seconds; 0: none)", name, text));
  }
  const long long value = std::stoll(std::string(t.substr(0, digits)));
  // Deadlines are kept in nanoseconds on a steady clock: a longer duration would wrap and fail every
  // operation at once. Nobody means more than a year.
  if (value > max_duration.count() / scale) {
    bad(fmt::format("{}='{}' is longer than a year (8760h), the longest duration weft takes; 0 means none", name, text));
  }
  return std::chrono::milliseconds(value * scale);
}

std::chrono::milliseconds env_duration(const char* name, std::chrono::milliseconds fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  return parse_duration(name, v);
}

}  // namespace weft::detail
