#include "core/log.hpp"

#include <cstdlib>
#include <mutex>

#include <spdlog/sinks/stdout_color_sinks.h>

namespace weft {

spdlog::logger& log() {
  static std::shared_ptr<spdlog::logger> logger = [] {
    auto existing = spdlog::get("weft");
    if (existing) return existing;
    auto made = spdlog::stderr_color_mt("weft");
    made->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [weft] [%l] %v");
    const char* level = std::getenv("WEFT_LOG_LEVEL");
    made->set_level(level ? spdlog::level::from_str(level) : spdlog::level::warn);
    return made;
  }();
  return *logger;
}

}  // namespace weft
