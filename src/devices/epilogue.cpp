// gpu::Epilogue (weft/gpu.hpp): the built-ins' description and checks, and applying one on the host.
// The arithmetic is kernels/cpu/epilogue.hpp's (and kernels/cuda/epilogue.cu's, element for element).
#include <cmath>
#include <string>

#include <fmt/format.h>

#include "devices/backend.hpp"
#include "devices/checks.hpp"
#include "kernels/cpu/epilogue.hpp"
#include "weft/error.hpp"
#include "weft/gpu.hpp"

namespace weft::gpu {
namespace {

constexpr int dtype_count = static_cast<int>(sizeof(all_dtypes) / sizeof(all_dtypes[0]));

std::string dtype_words(int code) {
  return code >= 0 && code < dtype_count ? std::string(to_string(static_cast<DType>(code))) : fmt::format("dtype #{}", code);
}

// The dtype a cast stores, refused at construction when it is no DType's value.
void check_cast_to(DType to, const char* op) {
  if (!is_valid(to)) throw Error(Errc::invalid_argument, {.op = op}, fmt::format("dtype {} is not a weft DType", static_cast<unsigned>(to)));
}

}  // namespace

Epilogue Epilogue::scale(double factor) {
  if (!std::isfinite(factor)) {
    throw Error(Errc::invalid_argument, {.op = "Epilogue::scale"}, fmt::format("the factor {} is not finite", factor));
  }
  Epilogue e;
  if (factor == 1.0) return e;
  e.kind_ = Kind::scale_and_cast;
  e.factor_ = factor;
  return e;
}

Epilogue Epilogue::cast(DType to) {
  check_cast_to(to, "Epilogue::cast");
  Epilogue e;
  e.kind_ = Kind::scale_and_cast;
  e.to_ = to;
  return e;
}

Epilogue Epilogue::scale_and_cast(double factor, DType to) {
  check_cast_to(to, "Epilogue::scale_and_cast");
  Epilogue e = scale(factor);
  e.kind_ = Kind::scale_and_cast;
  e.to_ = to;
  return e;
}

Epilogue Epilogue::custom(EpilogueFunctions functions, std::string name) {
  constexpr const char* op = "Epilogue::custom";
  if (!functions.launch && !functions.host) {
    throw Error(Errc::invalid_argument, {.op = op}, fmt::format("'{}' has neither a launch nor a host function", name));
  }
  for (const int code : {functions.input_dtype, functions.output_dtype}) {
    if (code < 0 || code >= dtype_count) {
      throw Error(Errc::invalid_argument, {.op = op}, fmt::format("'{}': {} is not one of weft's dtypes", name, dtype_words(code)));
    }
  }
  Epilogue e;
  e.kind_ = Kind::custom;
  e.functions_ = std::move(functions);
  e.name_ = std::move(name);
  return e;
}

DType Epilogue::output(DType input) const {
  switch (kind_) {
    case Kind::identity: return input;
    case Kind::scale_and_cast: return to_.value_or(input);
    case Kind::custom: break;
  }
  if (functions_.input_dtype != static_cast<int>(input)) {
    throw Error(Errc::invalid_argument, {.op = "epilogue"},
                fmt::format("{} takes {} elements, and the reduced ones are {}", describe(), dtype_words(functions_.input_dtype),
                            to_string(input)));
  }
  return static_cast<DType>(functions_.output_dtype);
}

std::string Epilogue::describe() const {
  switch (kind_) {
    case Kind::identity: return "identity";
    case Kind::scale_and_cast:
      if (!to_) return fmt::format("scale {}", factor_);
      if (factor_ == 1.0) return fmt::format("cast to {}", to_string(*to_));
      return fmt::format("scale {} and cast to {}", factor_, to_string(*to_));
    case Kind::custom: break;
  }
  return fmt::format("custom '{}' ({} -> {})", name_, dtype_words(functions_.input_dtype), dtype_words(functions_.output_dtype));
}

void Epilogue::apply(ConstBufferView in, BufferView out) const {
  constexpr const char* op = "Epilogue::apply";
  const DType to = output(in.dtype);
  if (in.device.kind != Device::Kind::host || out.device.kind != Device::Kind::host) {
    throw Error(Errc::invalid_argument, {.op = op}, "host memory only (a stream's apply() takes device memory)");
  }
  if (out.dtype != to || out.count != in.count) {
    throw Error(Errc::invalid_argument, {.op = op},
                fmt::format("{} x {} in, {} x {} out: {} stores {} x {}", in.count, to_string(in.dtype), out.count,
                            to_string(out.dtype), describe(), in.count, to_string(to)));
  }
  detail::check_overlap(in, out, op);
  if (in.count == 0) return;
  if (kind_ == Kind::custom) {
    if (!functions_.host) {
      throw Error(Errc::invalid_argument, {.op = op}, fmt::format("{} has no host function (it runs on a GPU only)", describe()));
    }
    functions_.host(functions_.functor.get(), in.data, out.data, 0, in.count);
    return;
  }
  kernels::apply_epilogue(in.data, in.dtype, out.data, to, in.count, factor_);
}

namespace detail {

void check_overlap(ConstBufferView in, BufferView out, const char* op) {
  const auto* a = static_cast<const std::byte*>(in.data);
  const auto* b = static_cast<const std::byte*>(out.data);
  if (in.count == 0 || !(a < b + out.bytes() && b < a + in.bytes())) return;
  if (a != b || dtype_size(in.dtype) != dtype_size(out.dtype)) {
    throw Error(Errc::invalid_argument, {.op = op},
                "the output overlaps the input: it may be the input itself (same start, same element size), nothing else");
  }
}

void check_epilogue_runs(const Epilogue& epilogue, const char* op) {
  const EpilogueFunctions* fns = epilogue.functions();
  if (!fns) return;
  if (gpu::backend() == gpu::Backend::cuda && !fns->launch) {
    throw Error(Errc::invalid_argument, {.op = op},
                fmt::format("the epilogue {} has no device function (Epilogue::on_host runs on the simulated device and "
                            "host memory only; a GPU needs weft/gpu_epilogue.cuh's make_epilogue_functions)",
                            epilogue.describe()));
  }
  if (gpu::backend() == gpu::Backend::sim && !fns->host) {
    throw Error(Errc::invalid_argument, {.op = op},
                fmt::format("the epilogue {} has no host function, which the simulated device runs", epilogue.describe()));
  }
}

}  // namespace detail
}  // namespace weft::gpu
