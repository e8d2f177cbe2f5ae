#pragma once
/// weft's version.
#include <string_view>

namespace weft {

/// "MAJOR.MINOR.PATCH" of the weft library this program runs with (for a shared library, the one
/// loaded, which may be newer than the headers it was built with).
std::string_view version() noexcept;

}  // namespace weft
