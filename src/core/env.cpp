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
}  // namespace

bool env_switch(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  const std::string_view text(v);
  if (text == "0" || text == "1") return text == "1";
  refuse(name, text, "a switch (valid: 0, 1)");
}

std::chrono::microseconds parse_microseconds(const char* name, const char* text, std::chrono::microseconds max) {
  const std::string_view digits(text);
  const auto wrong = [&] { refuse(name, digits, fmt::format("a whole number of microseconds from 0 to {}", max.count())); };
  if (digits.empty()) wrong();
  long long value = 0;
  for (const char c : digits) {
    if (c < '0' || c > '9') wrong();
    value = value * 10 + (c - '0');
    if (value > max.count()) wrong();  // before it could wrap
  }
  return std::chrono::microseconds(value);
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
  const std::string_view digits(text);
  const auto wrong = [&] { refuse(name, digits, fmt::format("a whole number from {} to {}", min, max)); };
  if (digits.empty()) wrong();
  long long value = 0;
  for (const char c : digits) {
    if (c < '0' || c > '9') wrong();
    value = value * 10 + (c - '0');
    if (value > max) wrong();  // before it could wrap
  }
  if (value < min) wrong();
  return value;
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
