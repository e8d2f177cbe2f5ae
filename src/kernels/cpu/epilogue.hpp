#pragma once
// The built-in epilogues (weft::gpu::Epilogue: scale, cast, scale and cast) on the CPU: the sim's device
// work, and the reference the GPU kernel (kernels/cuda/epilogue.cu) matches element by element.
//
// out[i] = convert<out_type>(in[i] * factor), where:
//   - factor 1 and one type: a copy (bitwise, NaN payloads too);
//   - factor 1, integers (or bool) to integers: C++'s conversion (modular; to bool: != 0);
//   - otherwise the value is taken to double (f16 and bf16 through float), multiplied by factor (skipped
//     when it is 1), and converted: to f64 as is; to f32 rounded to nearest even; to f16 / bf16 through
//     f32 (rounded twice, to nearest even each time); to bool: != 0 (NaN: true); to an integer: toward
//     zero, saturating at the type's limits, NaN to 0 (what the GPU's conversion instructions do).
// So an integer of more than 53 bits loses its low bits when scaled or cast to a float type.
#include <cstddef>

#include "weft/dtype.hpp"

namespace weft::kernels {

void apply_epilogue(const void* in, DType in_type, void* out, DType out_type, std::size_t count, double factor) noexcept;

}  // namespace weft::kernels
