#pragma once
// weft's one logger ("weft", stderr). Level from WEFT_LOG_LEVEL (trace, debug, info, warn, error, off;
// default warn). Nothing is logged per message on the hot path.
#include <spdlog/spdlog.h>

namespace weft {
spdlog::logger& log();
}
