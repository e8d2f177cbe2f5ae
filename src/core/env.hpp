#pragma once
// Tuning variables read from the environment, one spelling each. A value that is set but malformed is
// an error naming the variable (Errc::invalid_argument, op "configuration"), never a silent default:
// WEFT_SPIN_US=abc used to mean 0 and WEFT_LOG_LEVEL=zz turned every log line off.
#include <chrono>
#include <string_view>

namespace weft::detail {

/// A 0/1 switch; unset or empty: `fallback`. Throws on anything else.
bool env_switch(const char* name, bool fallback);
/// `text` as env_switch takes it (for a variable read through another lookup than getenv).
bool parse_switch(const char* name, const char* text);

/// A whole number of microseconds, 0 to `max`; unset or empty: `fallback`. Throws on anything else.
std::chrono::microseconds env_microseconds(const char* name, std::chrono::microseconds fallback,
                                           std::chrono::microseconds max = std::chrono::seconds(10));

/// `text` as env_microseconds takes it (for a variable read through another lookup than getenv).
std::chrono::microseconds parse_microseconds(const char* name, const char* text,
                                             std::chrono::microseconds max = std::chrono::seconds(10));

/// The same where no exception may leave (a value read lazily inside a noexcept path): `fallback` for a
/// malformed value, which the Loop's or the Group's construction refused before anyway.
std::chrono::microseconds env_microseconds_or(const char* name, std::chrono::microseconds fallback,
                                              std::chrono::microseconds max = std::chrono::seconds(10)) noexcept;

/// A whole number from `min` to `max`; unset or empty: `fallback`. Throws on anything else.
long long env_count(const char* name, long long fallback, long long min, long long max);
/// `text` as env_count takes it (for a variable read through another lookup than getenv).
long long parse_count(const char* name, const char* text, long long min, long long max);
/// The same for a variable that also takes words, which its caller reads first: `words` ("on, off")
/// are named in the refusal, so that it lists every value the variable takes.
long long parse_count(const char* name, const char* text, long long min, long long max, std::string_view words);
/// The same where no exception may leave (read lazily): `fallback` for a malformed value, which the
/// Loop's construction refused before anyway.
long long env_count_or(const char* name, long long fallback, long long min, long long max) noexcept;

/// A duration: a whole number with ms, s, m or h (no unit: seconds), up to max_duration (a year);
/// 0 means none. Throws on anything else, naming the variable.
std::chrono::milliseconds parse_duration(const char* name, const char* text);
/// The same from the environment; unset or empty: `fallback`.
std::chrono::milliseconds env_duration(const char* name, std::chrono::milliseconds fallback);

}  // namespace weft::detail
