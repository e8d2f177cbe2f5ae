#include "core/log.hpp"

#include <cstdlib>
#include <mutex>
#include <string_view>

#include <spdlog/sinks/stdout_color_sinks.h>

namespace weft {

spdlog::logger& log() {
  static std::shared_ptr<spdlog::logger> logger = [] {
    auto existing = spdlog::get("weft");
    if (existing) return existing;
    auto made = spdlog::stderr_color_mt("weft");
    made->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [weft] [%l] %v");
    // spdlog reads a name it does not know as "off": WEFT_LOG_LEVEL=zz silenced every warning and error.
    // An unknown name keeps the default and says so.
    const char* level = std::getenv("WEFT_LOG_LEVEL");
    const auto parsed = level && *level ? spdlog::level::from_str(level) : spdlog::level::warn;
    const bool known = parsed != spdlog::level::off || std::string_view(level) == "off";
    made->set_level(known ? parsed : spdlog::level::warn);
    if (!known) {
      made->warn("WEFT_LOG_LEVEL='{}' is not a level (trace, debug, info, warn, error, critical, off): warn is used", level);
    }
    return made;
  }();
  return *logger;
}

}  // namespace weft
