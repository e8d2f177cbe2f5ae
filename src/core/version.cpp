#include "weft/version.hpp"

#include "weft_config.h"

namespace weft {

std::string_view version() noexcept { return WEFT_VERSION; }

}  // namespace weft
