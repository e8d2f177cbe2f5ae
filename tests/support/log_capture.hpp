#pragma once
// What weft logs, collected for a test to read (warnings a test expects, or expects not to see).
#include <algorithm>
#include <initializer_list>
#include <memory>
#include <string>

#include <spdlog/sinks/ringbuffer_sink.h>

#include "core/log.hpp"

namespace weft::test {

// Collects what weft logs while it lives.
class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(4096)) { weft::log().sinks().push_back(sink_); }
  ~LogCapture() {
    auto& sinks = weft::log().sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
  }
  /// How many logged lines contain every one of `words`.
  int count(std::initializer_list<std::string> words) const {
    int n = 0;
    for (const auto& line : sink_->last_formatted()) {
      bool all = true;
      for (const auto& w : words) all = all && line.find(w) != std::string::npos;
      n += all ? 1 : 0;
    }
    return n;
  }
  std::string text() const {
    std::string out;
    for (const auto& line : sink_->last_formatted()) out += line;
    return out;
  }

 private:
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> sink_;
};

}  // namespace weft::test
