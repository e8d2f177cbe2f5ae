// weft's Python module, the native half (_weft): Groups, their operations over numpy arrays, and the
// completion channel that tells an asyncio loop which operations finished. The Python half
// (weft/__init__.py) allocates outputs, checks shapes, and turns operations into awaitables.
//
// Threads: the operations run on one weft::Loop per process (its progress thread, or a thread blocked in
// wait() driving it). No Python object is touched off the thread that holds the GIL: an operation that
// completes records its outcome in plain C++ (Flight), writes its id to the group's eventfd, and the
// arrays it uses are kept alive by the Work object and by the group's in-flight table until the
// completion has been reaped under the GIL.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <cerrno>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <weft/gpu.hpp>
#include <weft/weft.hpp>

namespace py = pybind11;
using namespace weft;

namespace {

// ---- errors

py::object error_type;  // weft.Error (a RuntimeError); set at import

std::string errc_name(Errc e) {
  switch (e) {
    case Errc::invalid_argument: return "invalid_argument";
    case Errc::peer_failure: return "peer_failure";
    case Errc::timeout: return "timeout";
    case Errc::cancelled: return "cancelled";
    case Errc::size_mismatch: return "size_mismatch";
    case Errc::protocol_error: return "protocol_error";
    case Errc::group_failed: return "group_failed";
    case Errc::aborted: return "aborted";
    case Errc::connection_failed: return "connection_failed";
    case Errc::mismatch: return "mismatch";
    case Errc::refused: return "refused";
    case Errc::would_deadlock: return "would_deadlock";
    case Errc::device_failure: return "device_failure";
  }
  return "unknown";
}

// Raises weft.Error(message) with .errc (its name), .rank, .peer, .op and .seq.
[[noreturn]] void raise(const Error& e) {
  py::object instance = error_type(py::str(e.what()));
  instance.attr("errc") = errc_name(e.errc());
  instance.attr("rank") = e.context().rank;
  instance.attr("peer") = e.context().peer;
  instance.attr("op") = e.context().op;
  instance.attr("seq") = e.context().seq;
  PyErr_SetObject(error_type.ptr(), instance.ptr());
  throw py::error_already_set();
}

[[noreturn]] void raise_invalid(const std::string& what) { raise(Error(Errc::invalid_argument, ErrorContext{}, what)); }

// ---- the process's loop

std::mutex loop_mutex;
Loop* the_loop = nullptr;  // created by the first Group.create; deleted by _shutdown (atexit)
pid_t loop_pid = 0;        // the process that made it

// A child forked from a process with a Loop (os.fork after Group.create) has the Loop's memory but not
// its progress thread: anything that ran it, stopped it or destroyed it there waited for a thread that
// does not exist (a child that left through sys.exit hung in atexit). The child leaves the parent's Loop
// and its groups alone (leaked: they are the parent's), and makes a Loop of its own if it makes groups.
bool forked_away(pid_t owner) { return owner != 0 && owner != ::getpid(); }

Loop& loop() {
  std::lock_guard lock(loop_mutex);
  if (the_loop && forked_away(loop_pid)) the_loop = nullptr;  // the parent's (left as it is)
  if (!the_loop) {
    the_loop = new Loop();
    loop_pid = ::getpid();
  }
  return *the_loop;
}

// ---- arrays

DType dtype_of(const py::dtype& d) {
  const char kind = d.kind();
  const auto size = d.itemsize();
  const std::string name = py::str(d.attr("name"));
  // Bytes in the other order would be summed as if native: a big-endian array of ones all-reduced to
  // 4.25e37 before, without a word.
  if (size > 1 && !d.attr("isnative").cast<bool>()) {
    raise_invalid("numpy dtype '" + py::str(d.attr("str")).cast<std::string>() +
                  "' is not in this machine's byte order, which weft computes in: convert it first, "
                  "x.astype(x.dtype.newbyteorder('='))");
  }
  if (name == "bfloat16") return DType::bf16;  // ml_dtypes' bfloat16
  if (kind == 'b' && size == 1) return DType::boolean;
  if (kind == 'i') {
    switch (size) {
      case 1: return DType::i8;
      case 2: return DType::i16;
      case 4: return DType::i32;
      case 8: return DType::i64;
    }
  }
  if (kind == 'u') {
    switch (size) {
      case 1: return DType::u8;
      case 2: return DType::u16;
      case 4: return DType::u32;
      case 8: return DType::u64;
    }
  }
  if (kind == 'f') {
    switch (size) {
      case 2: return DType::f16;
      case 4: return DType::f32;
      case 8: return DType::f64;
    }
  }
  raise_invalid("weft has no element type for numpy dtype " + name + " (bool, int8-64, uint8-64, float16/32/64, bfloat16)");
}

// The array's strides in elements (numpy's are in bytes; views whose strides are not whole elements
// cannot be described).
std::vector<std::ptrdiff_t> element_strides(const py::array& a) {
  std::vector<std::ptrdiff_t> strides(static_cast<std::size_t>(a.ndim()));
  const auto item = static_cast<std::ptrdiff_t>(a.itemsize());
  for (py::ssize_t k = 0; k < a.ndim(); ++k) {
    const auto s = static_cast<std::ptrdiff_t>(a.strides(k));
    if (s % item != 0) raise_invalid("an array whose strides are not whole elements cannot be sent");
    strides[static_cast<std::size_t>(k)] = s / item;
  }
  return strides;
}

std::vector<std::size_t> shape_of(const py::array& a) {
  std::vector<std::size_t> shape(static_cast<std::size_t>(a.ndim()));
  for (py::ssize_t k = 0; k < a.ndim(); ++k) shape[static_cast<std::size_t>(k)] = static_cast<std::size_t>(a.shape(k));
  return shape;
}

// ---- device arrays: weft::gpu memory (CUDA, or the simulated device) with a shape and a numpy dtype

// One stream per device, on the process's loop, for the copies of to_device and cpu; dropped by
// _shutdown before the loop they complete on.
std::mutex streams_mutex;
std::map<int, std::unique_ptr<gpu::Stream>> streams;

gpu::Stream& stream_for(Device device) {
  std::lock_guard lock(streams_mutex);
  auto& s = streams[device.index];
  if (!s) s = std::make_unique<gpu::Stream>(loop(), device);
  return *s;
}

// DLPack (the exchange format of numpy, PyTorch, CuPy, JAX): the unversioned ABI that __dlpack__ hands
// out in a capsule named "dltensor" (renamed "used_dltensor" by the consumer that takes it).
namespace dlpack {
struct Device {
  std::int32_t device_type;  // 1: CPU, 2: CUDA
  std::int32_t device_id;
};
struct DataType {
  std::uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat, 6 bool
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  std::int32_t ndim;
  DataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // null: row-major
  std::uint64_t byte_offset;
};
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};
constexpr std::int32_t cpu = 1;
constexpr std::int32_t cuda = 2;

DataType type_of(const py::dtype& d) {
  const std::string name = py::str(d.attr("name"));
  const auto bits = static_cast<std::uint8_t>(d.itemsize() * 8);
  if (name == "bfloat16") return {4, 16, 1};
  switch (d.kind()) {
    case 'b': return {6, 8, 1};
    case 'i': return {0, bits, 1};
    case 'u': return {1, bits, 1};
    case 'f': return {2, bits, 1};
  }
  raise_invalid("no DLPack type for numpy dtype " + name);
}

py::dtype numpy_of(const DataType& t) {
  if (t.lanes != 1) raise_invalid("DLPack tensors with vector lanes cannot be moved");
  const char* kinds[] = {"i", "u", "f", nullptr, nullptr, nullptr, "b"};
  if (t.code == 4 && t.bits == 16) raise_invalid("a bfloat16 DLPack tensor needs ml_dtypes' bfloat16 in numpy; not supported here");
  if (t.code > 6 || kinds[t.code] == nullptr) raise_invalid("DLPack type code " + std::to_string(t.code) + " is not a number type weft moves");
  if (t.code == 6) return py::dtype("bool");
  return py::dtype(std::string(kinds[t.code]) + std::to_string(t.bits / 8));
}
}  // namespace dlpack

[[noreturn]] void buffer_error(const std::string& what) {
  PyErr_SetString(PyExc_BufferError, what.c_str());
  throw py::error_already_set();
}

// Device memory with a shape and a numpy dtype: weft's own allocation (a gpu::DeviceBuffer), or another
// library's tensor taken through DLPack (kept alive until this array and its views are gone).
class DeviceArray {
 public:
  DeviceArray(std::shared_ptr<void> owner, void* data, std::size_t bytes, Device device, std::vector<std::size_t> shape, py::dtype dtype)
      : owner_(std::move(owner)), data_(data), bytes_(bytes), device_(device), shape_(std::move(shape)), dtype_(std::move(dtype)) {}

  static DeviceArray empty(const std::vector<std::size_t>& shape, const py::object& dtype_like, int device) {
    const py::dtype dtype = py::dtype::from_args(dtype_like);
    (void)dtype_of(dtype);  // a dtype weft moves
    std::size_t n = static_cast<std::size_t>(dtype.itemsize());
    for (std::size_t e : shape) n *= e;
    try {
      auto buffer = std::make_shared<gpu::DeviceBuffer>(gpu::DeviceBuffer::allocate(gpu::device(device), n));
      void* data = buffer->data();
      const Device where = buffer->device();
      return DeviceArray(std::move(buffer), data, n, where, shape, dtype);
    } catch (const Error& e) {
      raise(e);
    }
  }

  // A copy of host array `x` (C-contiguous) on `device`.
  static DeviceArray from_host(const py::array& x, int device) {
    DeviceArray d = empty(shape_of(x), x.dtype(), device);
    d.copy_from(ConstBufferView(x.data(), static_cast<std::size_t>(x.nbytes()), DType::u8));
    return d;
  }
  // The host copy (numpy).
  py::array to_host() const {
    py::array out(dtype_, std::vector<py::ssize_t>(shape_.begin(), shape_.end()));
    copy(BufferView(out.mutable_data(), static_cast<std::size_t>(out.nbytes()), DType::u8), ConstBufferView(data_, bytes_, DType::u8, device_));
    return out;
  }
  DeviceArray clone() const {
    DeviceArray d = empty(shape_, dtype_, device_.index);
    d.copy_from(ConstBufferView(data_, bytes_, DType::u8, device_));
    return d;
  }

  // ---- DLPack: only CUDA memory is shared (the simulated device's memory is host memory that weft
  // tracks: handing it out as CUDA memory would be a lie that a consumer pays for with a crash).
  py::tuple dlpack_device() const {
    require_cuda("__dlpack_device__");
    return py::make_tuple(dlpack::cuda, device_.index);
  }
  // The data is ready on every stream: weft's operations have completed (and synchronised their
  // device work) before their results are handed to Python, so `stream` needs no wait.
  py::capsule dlpack(py::object /*stream*/) const {
    require_cuda("__dlpack__");
    struct Context {
      std::shared_ptr<void> owner;
      std::vector<std::int64_t> shape;
      dlpack::ManagedTensor managed;
    };
    auto* ctx = new Context{owner_, std::vector<std::int64_t>(shape_.begin(), shape_.end()), {}};
    ctx->managed.dl_tensor = dlpack::Tensor{data_, {dlpack::cuda, device_.index}, static_cast<std::int32_t>(shape_.size()),
                                            dlpack::type_of(dtype_), ctx->shape.data(), nullptr, 0};
    ctx->managed.manager_ctx = ctx;
    ctx->managed.deleter = [](dlpack::ManagedTensor* self) { delete static_cast<Context*>(self->manager_ctx); };
    return py::capsule(&ctx->managed, "dltensor", [](PyObject* capsule) {
      // Not taken by a consumer: ours to free.
      if (PyCapsule_IsValid(capsule, "dltensor")) {
        auto* m = static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
        if (m && m->deleter) m->deleter(m);
      }
    });
  }
  // Another library's CUDA tensor (its __dlpack__ capsule), without a copy: contiguous, row-major.
  static DeviceArray from_dlpack(py::capsule capsule) {
    if (!PyCapsule_IsValid(capsule.ptr(), "dltensor")) raise_invalid("from_dlpack: not an unused DLPack capsule");
    auto* m = static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
    const dlpack::Tensor& t = m->dl_tensor;
    if (t.device.device_type != dlpack::cuda) raise_invalid("from_dlpack: the tensor is not in CUDA memory (numpy takes host tensors)");
    if (gpu::backend() != gpu::Backend::cuda) {
      raise_invalid("from_dlpack: a CUDA tensor needs weft's cuda backend, and this process uses the " +
                    std::string(gpu::backend_name()) + " one (WEFT_GPU)");
    }
    std::vector<std::size_t> shape(static_cast<std::size_t>(t.ndim));
    std::size_t elements = 1;
    for (std::int32_t k = 0; k < t.ndim; ++k) elements *= shape[static_cast<std::size_t>(k)] = static_cast<std::size_t>(t.shape[k]);
    if (t.strides) {
      std::int64_t expected = 1;
      for (std::int32_t k = t.ndim; k-- > 0;) {
        if (t.shape[k] != 1 && t.strides[k] != expected) raise_invalid("from_dlpack: the tensor is not contiguous (call .contiguous() first)");
        expected *= t.shape[k];
      }
    }
    const py::dtype dtype = dlpack::numpy_of(t.dtype);
    void* data = static_cast<std::byte*>(t.data) + t.byte_offset;
    PyCapsule_SetName(capsule.ptr(), "used_dltensor");
    std::shared_ptr<void> owner(m, [](void* p) {
      auto* managed = static_cast<dlpack::ManagedTensor*>(p);
      if (managed->deleter) managed->deleter(managed);
    });
    return DeviceArray(std::move(owner), data, elements * static_cast<std::size_t>(dtype.itemsize()), Device{Device::Kind::cuda, t.device.device_id},
                       shape, dtype);
  }

  TensorView view() const { return TensorView{data_, dtype_of(dtype_), shape_, {}, device_}; }
  BufferView flat() const { return BufferView(data_, size(), dtype_of(dtype_), device_); }
  py::tuple shape() const { return py::cast(std::vector<py::ssize_t>(shape_.begin(), shape_.end())); }
  py::dtype dtype() const { return dtype_; }
  int device() const { return device_.index; }
  std::size_t size() const { return bytes_ / static_cast<std::size_t>(dtype_.itemsize()); }
  std::size_t ndim() const { return shape_.size(); }
  std::string repr() const {
    std::string dims;
    for (std::size_t e : shape_) dims += (dims.empty() ? "" : ", ") + std::to_string(e);
    return "weft.DeviceArray(shape=(" + dims + (shape_.size() == 1 ? ",)" : ")") + ", dtype=" + py::str(dtype_.attr("name")).cast<std::string>() +
           ", device=" + std::to_string(device()) + " (" + std::string(gpu::backend_name()) + "))";
  }

 private:
  static void require_cuda(const char* what) {
    if (gpu::backend() != gpu::Backend::cuda) {
      buffer_error(std::string(what) + ": this DeviceArray lives on weft's simulated device (host memory weft tracks), which "
                   "other libraries cannot use; weft.cpu(x) gives a numpy array");
    }
  }
  void copy_from(ConstBufferView src) { copy(BufferView(data_, bytes_, DType::u8, device_), src); }
  void copy(BufferView dst, ConstBufferView src) const {
    try {
      Future<void> done = stream_for(device_).copy(dst, src);
      py::gil_scoped_release unlocked;
      done.get();
    } catch (const Error& e) {
      raise(e);
    }
  }

  std::shared_ptr<void> owner_;  // the gpu::DeviceBuffer, or the DLPack producer's tensor
  void* data_;
  std::size_t bytes_;
  Device device_;
  std::vector<std::size_t> shape_;
  py::dtype dtype_;
};

bool on_device(const py::handle& o) { return py::isinstance<DeviceArray>(o); }

ConstTensorView const_view(const py::object& o) {
  if (on_device(o)) return o.cast<const DeviceArray&>().view();
  const auto a = o.cast<py::array>();
  return ConstTensorView(a.data(), dtype_of(a.dtype()), shape_of(a), element_strides(a));
}

TensorView mutable_view(const py::object& o) {
  if (on_device(o)) return o.cast<const DeviceArray&>().view();
  auto a = o.cast<py::array>();
  if (!a.writeable()) raise_invalid("the output array is read-only");
  return TensorView{a.mutable_data(), dtype_of(a.dtype()), shape_of(a), element_strides(a)};
}

// A flat buffer view of a C-contiguous array or a device array (the buffer-level collectives).
BufferView flat(const py::object& o, const char* what) {
  if (on_device(o)) return o.cast<const DeviceArray&>().flat();
  auto a = o.cast<py::array>();
  if (!(a.flags() & py::array::c_style)) raise_invalid(std::string(what) + " must be C-contiguous");
  if (!a.writeable()) raise_invalid(std::string(what) + " is read-only");
  return BufferView(a.mutable_data(), static_cast<std::size_t>(a.size()), dtype_of(a.dtype()));
}
ConstBufferView const_flat(const py::object& o, const char* what) {
  if (on_device(o)) return o.cast<const DeviceArray&>().flat();
  const auto a = o.cast<py::array>();
  if (!(a.flags() & py::array::c_style)) raise_invalid(std::string(what) + " must be C-contiguous");
  return ConstBufferView(a.data(), static_cast<std::size_t>(a.size()), dtype_of(a.dtype()));
}

const std::vector<std::string> plan_builders = {
    "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "bidirectional_ring_all_reduce", "recursive_doubling_all_reduce",
    "rabenseifner_all_reduce", "tree_all_reduce", "binomial_broadcast", "chain_broadcast", "binomial_reduce",
    "pairwise_all_to_all", "dissemination_barrier"};

// ---- plans (weft/algorithms.hpp) as plain Python data: (kind, send_to, recv_from, send, recv) with
// ranges as (offset, count)
using StepTuple = std::tuple<std::string, int, int, std::pair<std::size_t, std::size_t>, std::pair<std::size_t, std::size_t>>;

constexpr algorithms::StepKind all_step_kinds[] = {
    algorithms::StepKind::send,          algorithms::StepKind::recv,           algorithms::StepKind::recv_reduce,
    algorithms::StepKind::recv_reduce_send, algorithms::StepKind::recv_copy_send, algorithms::StepKind::send_recv,
    algorithms::StepKind::send_recv_reduce};

std::vector<StepTuple> steps_of(const algorithms::Plan& plan) {
  std::vector<StepTuple> out;
  out.reserve(plan.size());
  for (const auto& s : plan) {
    out.emplace_back(std::string(algorithms::to_string(s.kind)), s.send_to, s.recv_from, std::pair{s.send.offset, s.send.count},
                     std::pair{s.recv.offset, s.recv.count});
  }
  return out;
}

// A plan from Python's steps, each range checked against the buffer it moves through (Python knows the
// arrays' sizes, which PlanBuffers does not carry: a range past its array is refused here, not written).
algorithms::Plan plan_of(const std::vector<StepTuple>& steps, std::size_t send_count, std::size_t recv_count) {
  algorithms::Plan plan;
  plan.reserve(steps.size());
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const auto& [kind_name, send_to, recv_from, send, recv] = steps[i];
    const auto* kind = std::find_if(std::begin(all_step_kinds), std::end(all_step_kinds),
                                    [&](algorithms::StepKind k) { return algorithms::to_string(k) == kind_name; });
    if (kind == std::end(all_step_kinds)) {
      std::string known;
      for (auto k : all_step_kinds) known += (known.empty() ? "" : ", ") + std::string(algorithms::to_string(k));
      raise_invalid(fmt::format("run_plan: step {} has kind '{}' (known: {})", i, kind_name, known));
    }
    const bool sends = *kind != algorithms::StepKind::recv && *kind != algorithms::StepKind::recv_reduce;
    const bool receives = *kind != algorithms::StepKind::send;
    const bool forwards = *kind == algorithms::StepKind::recv_reduce_send || *kind == algorithms::StepKind::recv_copy_send;
    const auto fits = [&](const char* which, const std::pair<std::size_t, std::size_t>& range, std::size_t count, const char* array) {
      if (range.first > count || range.second > count - range.first) {
        raise_invalid(fmt::format("run_plan: step {} ({}): its {} range [{}, +{}) reaches past {} ({} elements)", i, kind_name, which,
                                  range.first, range.second, array, count));
      }
    };
    if (sends) fits("send", send, forwards ? recv_count : send_count, forwards ? "out (forwarded from it)" : "x");
    if (receives) fits("recv", recv, recv_count, "out");
    plan.push_back(algorithms::Step{*kind, send_to, recv_from, {send.first, send.second}, {recv.first, recv.second}});
  }
  return plan;
}

// run_plan keeps its name for the operation's life (a const char*): names are kept here, one copy each.
const char* plan_name(const std::string& name) {
  static std::mutex m;
  static std::set<std::string> names;
  std::lock_guard lock(m);
  return names.insert(name).first->c_str();
}

// The public builders by name: rank `rank` of `size`, `count` elements (root where the plan has one).
algorithms::Plan built_plan(const std::string& name, int size, int rank, std::size_t count, int root) {
  namespace a = algorithms;
  if (size < 1) raise_invalid(fmt::format("plan: size {} must be at least 1", size));
  if (rank < 0 || rank >= size) raise_invalid(fmt::format("plan: rank {} is not in [0, {})", rank, size));
  if (root < 0 || root >= size) raise_invalid(fmt::format("plan: root {} is not in [0, {})", root, size));
  if (count > (std::size_t{1} << 47)) raise_invalid(fmt::format("plan: count {} is past 2^47", count));
  const auto blocks = a::blocks_of(count, size);
  if (name == "ring_reduce_scatter") return a::ring_reduce_scatter(size, rank, blocks, -1);
  if (name == "ring_all_gather") return a::ring_all_gather(size, rank, blocks, -1);
  if (name == "ring_all_reduce") return a::ring_all_reduce(size, rank, count);
  if (name == "bidirectional_ring_all_reduce") return a::bidirectional_ring_all_reduce(size, rank, count);
  if (name == "recursive_doubling_all_reduce") return a::recursive_doubling_all_reduce(size, rank, count);
  if (name == "rabenseifner_all_reduce") return a::rabenseifner_all_reduce(size, rank, count);
  if (name == "tree_all_reduce") return a::tree_all_reduce(size, rank, count);
  if (name == "binomial_broadcast") return a::binomial_broadcast(size, rank, root, count);
  if (name == "chain_broadcast") return a::chain_broadcast(size, rank, root, count);
  if (name == "binomial_reduce") return a::binomial_reduce(size, rank, root, count);
  if (name == "pairwise_all_to_all") return a::pairwise_all_to_all(size, rank, count);
  if (name == "dissemination_barrier") return a::dissemination_barrier(size, rank);
  raise_invalid(fmt::format("plan: no builder named '{}' (known: {})", name, fmt::join(plan_builders, ", ")));
}

ReduceOp op_named(const std::string& name) {
  if (const auto op = parse_reduce_op(name)) return *op;
  if (name == "and") return ReduceOp::logical_and;  // the seed API's spellings
  if (name == "or") return ReduceOp::logical_or;
  std::string known;
  for (ReduceOp op : all_reduce_ops) known += (known.empty() ? "" : ", ") + std::string(to_string(op));
  raise_invalid("unknown reduce op '" + name + "' (known: " + known + ")");
}

// Blocks with the GIL released until `done_within(slice)` returns true, or `seconds` (if finite) passed,
// in slices of at most 100 ms between which Python's signal handlers run: Ctrl-C raises KeyboardInterrupt
// here instead of being held until the wait ends (Group.create waiting for ranks that never come, a
// wait(timeout=3600) on a collective a peer never joins). What was waited for goes on. Returns whether
// it completed.
template <class DoneWithin>
bool wait_interruptibly(DoneWithin done_within, double seconds = std::numeric_limits<double>::infinity()) {
  using clock = std::chrono::steady_clock;
  constexpr std::chrono::milliseconds slice_most{100};
  const bool bounded = seconds < 1e9;  // beyond ~31 years: no limit (the clock would overflow)
  const auto until = bounded ? clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(seconds))
                             : clock::time_point::max();
  for (;;) {
    const auto left = until - clock::now();
    const auto slice = bounded ? std::clamp(std::chrono::duration_cast<clock::duration>(left), clock::duration::zero(),
                                            std::chrono::duration_cast<clock::duration>(slice_most))
                               : std::chrono::duration_cast<clock::duration>(slice_most);
    bool done = false;
    {
      py::gil_scoped_release unlocked;
      done = done_within(slice);
    }
    if (done) return true;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (bounded && clock::now() >= until) return false;
  }
}

// ---- operations in flight and the completion channel

// What an operation's completion leaves behind, written on the loop's thread before its id is posted.
struct Flight {
  std::uint64_t id = 0;
  Future<void> watcher;             // completes once the outcome is recorded and the id posted
  std::atomic<bool> done{false};
  std::exception_ptr error;         // set before `done`
};

// The wake-up of an asyncio loop that awaits this group's operations (an eventfd it watches), and the ids
// of the operations that completed since they were last taken (for the in-flight table). The eventfd is
// written only while armed (an asyncio loop watches it): plain wait() pays no system call for it.
class Completions {
 public:
  Completions() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
    if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
  }
  ~Completions() { ::close(fd_); }
  int fd() const { return fd_; }
  void arm() { armed_.store(true, std::memory_order_seq_cst); }
  void post(std::uint64_t id) {
    {
      std::lock_guard lock(mutex_);
      ids_.push_back(id);
    }
    if (armed_.load(std::memory_order_seq_cst)) {
      const std::uint64_t one = 1;
      [[maybe_unused]] const auto n = ::write(fd_, &one, sizeof one);  // EAGAIN only at 2^64-1 pending: still readable
    }
  }
  // Clears the wake-up (the asyncio reader calls this before it looks at its waiters).
  void clear() {
    std::uint64_t count = 0;
    [[maybe_unused]] const auto n = ::read(fd_, &count, sizeof count);  // EAGAIN: nothing new
  }
  std::vector<std::uint64_t> take() {
    std::lock_guard lock(mutex_);
    std::vector<std::uint64_t> out;
    out.swap(ids_);
    return out;
  }

 private:
  int fd_;
  std::atomic<bool> armed_{false};
  std::mutex mutex_;
  std::vector<std::uint64_t> ids_;
};

Task<void> watch(Future<void> op, std::shared_ptr<Flight> flight, std::shared_ptr<Completions> completions) {
  try {
    co_await std::move(op);
  } catch (...) {
    flight->error = std::current_exception();
  }
  flight->done.store(true, std::memory_order_release);
  completions->post(flight->id);
}

// One operation, as Python sees it: pollable, waitable (the GIL released), cancellable; its result is
// what the Python half asked to be returned (the output array, or None).
class Work {
 public:
  Work(std::shared_ptr<Flight> flight, py::object result, py::object keep)
      : flight_(std::move(flight)), result_(std::move(result)), keep_(std::move(keep)) {}
  std::uint64_t id() const { return flight_->id; }
  bool done() const { return flight_->done.load(std::memory_order_acquire); }
  // The result, or weft.Error; the operation must be done.
  py::object result() const {
    if (!done()) raise_invalid("the operation has not completed yet (wait() or await it)");
    if (flight_->error) {
      try {
        std::rethrow_exception(flight_->error);
      } catch (const Error& e) {
        raise(e);
      }
    }
    return result_;
  }
  // Blocks until done, driving weft's loop on this thread where it can (the GIL released), in slices of
  // 100 ms between which Python's signal handlers run: Ctrl-C raises KeyboardInterrupt here instead of
  // waiting for the operation (which goes on; cancel() it).
  py::object wait() {
    if (!done()) {
      wait_interruptibly([&](auto slice) {
        const auto until = std::chrono::steady_clock::now() + slice;
        const bool drove = loop().drive_until([&] { return done() || std::chrono::steady_clock::now() >= until; });
        if (!drove) flight_->watcher.wait_for(slice);
        return done();
      });
    }
    return result();
  }
  bool wait_for(double seconds) {
    return wait_interruptibly([&](auto slice) { return flight_->watcher.wait_for(slice); }, seconds);
  }
  // Drives weft's loop on this thread (as wait() does, the GIL released) until the operation is done or
  // `microseconds` passed; returns done(). An await spends this before it hands the wait to the asyncio
  // loop: a small collective is often done by then, and a completion that has to wake the asyncio
  // thread through its selector costs more (bench/RESULTS.md, "Python"). Where the loop cannot be
  // borrowed (io_uring's single-issuer mode), it does not wait: polling beside the progress thread would
  // only take its core.
  bool spin(double microseconds) {
    if (done() || microseconds <= 0) return done();
    py::gil_scoped_release unlocked;
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double, std::micro>(microseconds);
    loop().drive_until([&] { return done() || std::chrono::steady_clock::now() >= until; });
    return done();
  }
  void cancel() { flight_->watcher.cancel(); }

 private:
  std::shared_ptr<Flight> flight_;
  py::object result_;
  py::object keep_;  // the arrays the operation reads and writes
};

// A deadline given in seconds (0: none) as milliseconds. Checked before the cast: NaN or 1e300 seconds
// made no number of milliseconds (undefined behaviour), and a negative one was taken; weft refuses more
// than a year. Rounded up, so that a deadline shorter than a millisecond is one, not none.
std::chrono::milliseconds deadline_of(const py::handle& value, const std::string& what) {
  const double seconds = value.cast<double>();
  if (!(seconds >= 0) || seconds > 1e10) {
    raise_invalid(what + py::repr(value).cast<std::string>() + " is not a number of seconds from 0 (no deadline) to a year");
  }
  return std::chrono::milliseconds(static_cast<long long>(std::ceil(seconds * 1000)));
}

// A Group with its completion channel and the operations in flight.
class PyGroup {
 public:
  explicit PyGroup(Group group) : group_(std::move(group)), completions_(std::make_shared<Completions>()), pid_(::getpid()) {}
  ~PyGroup() { close(); }

  static std::unique_ptr<PyGroup> create(py::dict kwargs) {
    Options options;
    for (auto [key, value] : kwargs) {
      const std::string k = py::str(key);
      if (value.is_none()) continue;
      if (k == "rank") options.rank = value.cast<int>();
      else if (k == "world_size") options.world_size = value.cast<int>();
      else if (k == "store") options.store = value.cast<std::string>();
      else if (k == "transport") options.transport = value.cast<std::string>();
      else if (k == "timeout") options.timeout = deadline_of(value, "Group.create: timeout=");
      else if (k == "secret") options.secret = value.cast<std::string>();
      else if (k == "algorithms") options.algorithms = value.cast<std::string>();
      else if (k == "tuning_file") options.tuning_file = value.cast<std::string>();
      else {
        raise_invalid("Group.create has no option '" + k +
                      "' (rank, world_size, store, transport, timeout, secret, algorithms, tuning_file)");
      }
    }
    Loop& l = loop();
    try {
      Future<Group> created = Group::create(l, options);
      wait_interruptibly([&](auto slice) { return created.wait_for(slice); });
      return std::make_unique<PyGroup>(created.get());
    } catch (const Error& e) {
      raise(e);
    }
  }

  // The group, for an operation: not in a child forked after it was made (its loop runs in the parent).
  Group& group() {
    Group& g = handle();
    if (forked_away(pid_)) {
      raise_invalid("this group was made by process " + std::to_string(pid_) + ", and this process (" + std::to_string(::getpid()) +
                    ") is a child forked from it: its connections and loop are the parent's; make a group in the child "
                    "(Group.create), or start workers with multiprocessing's 'spawn'");
    }
    return g;
  }
  // The group's fixed facts (rank, size), readable in a forked child too.
  Group& handle() {
    if (!group_.valid()) raise_invalid("the group is closed");
    return group_;
  }
  int rank() { return handle().rank(); }
  int size() { return handle().size(); }
  std::string transport() { return std::string(handle().transport_name()); }
  bool has_shared_arena() { return handle().has_shared_arena(); }
  int fd() const { return completions_->fd(); }

  // Starts `op` (a weft call that may throw) and returns its Work, which returns `result` and keeps
  // `keep` (the arrays) alive; so does the in-flight table until the completion is reaped.
  template <class Start>
  Work start(py::object result, py::object keep, Start&& op) {
    reap();
    Future<void> started;
    try {
      started = op(group());
    } catch (const Error& e) {
      raise(e);
    }
    auto flight = std::make_shared<Flight>();
    flight->id = ++next_id_;
    flight->watcher = spawn(group_.loop(), watch(std::move(started), flight, completions_));
    inflight_.emplace(flight->id, Held{flight, keep});
    return Work(flight, std::move(result), std::move(keep));
  }

  // Releases the arrays of the operations that completed since the last call (every start() does).
  void reap() {
    for (std::uint64_t id : completions_->take()) inflight_.erase(id);
  }
  // For the asyncio reader: arms the eventfd (from now on every completion writes it) / clears it.
  void arm() { completions_->arm(); }
  void clear_wakeup() {
    completions_->clear();
    reap();
  }

  // Shuts the group down. Operations still running are aborted first (here and on every member: their
  // buffers could not outlive the group otherwise) and waited for; a group whose operations all
  // completed leaves as a C++ Group does, failing nobody.
  void close() {
    if (!group_.valid()) return;
    if (forked_away(pid_)) {
      // The parent's: aborting or releasing it here would run its loop, which has no thread in this
      // process. Left as it is (the child's copy of memory ends with the child).
      new Group(std::move(group_));
      new std::unordered_map<std::uint64_t, Held>(std::move(inflight_));
      inflight_.clear();
      return;
    }
    std::vector<std::shared_ptr<Flight>> running;
    for (auto& [id, held] : inflight_) {
      if (!held.flight->done.load(std::memory_order_acquire)) running.push_back(held.flight);
    }
    {
      py::gil_scoped_release unlocked;
      if (!running.empty()) group_.abort("its Python group was closed with operations in flight");
      for (auto& flight : running) flight->watcher.wait();
      group_ = Group();
    }
    inflight_.clear();
  }
  bool closed() const { return !group_.valid(); }
  std::size_t in_flight() const { return inflight_.size(); }

  std::unique_ptr<PyGroup> split(int color, int key) {
    try {
      Future<Group> f = group().split(color, key);
      wait_interruptibly([&](auto slice) { return f.wait_for(slice); });
      return std::make_unique<PyGroup>(f.get());
    } catch (const Error& e) {
      raise(e);
    }
  }
  void abort(const std::string& reason) { group().abort(reason); }
  std::unique_ptr<PyGroup> shrink() {
    try {
      Future<Group> f = group().shrink();
      wait_interruptibly([&](auto slice) { return f.wait_for(slice); });
      return std::make_unique<PyGroup>(f.get());
    } catch (const Error& e) {
      raise(e);
    }
  }
  // A view sharing the group (Group::with_timeout), with a completion channel and in-flight table of its own.
  std::unique_ptr<PyGroup> with_timeout(const py::object& seconds) {
    const auto timeout = deadline_of(seconds, "with_timeout: ");
    return std::make_unique<PyGroup>(group().with_timeout(timeout));
  }
  std::string transport_to(int peer) { return std::string(group().transport_to(peer)); }
  void override_algorithms(const std::string& spec) { group().override_algorithms(spec); }
  std::string algorithm_for(const std::string& collective, std::size_t bytes) { return group().algorithm_for(collective, bytes); }

 private:
  struct Held {
    std::shared_ptr<Flight> flight;
    py::object keep;
  };
  Group group_;
  std::shared_ptr<Completions> completions_;
  std::unordered_map<std::uint64_t, Held> inflight_;
  std::uint64_t next_id_ = 0;
  pid_t pid_;  // the process that made the group (a forked child must not run it)
};

using Pairs = std::vector<std::pair<int, int>>;
using Counts = std::vector<std::size_t>;

}  // namespace

PYBIND11_MODULE(_weft, m) {
  m.doc() = "weft's native module: use the weft package";
  error_type = py::reinterpret_borrow<py::object>(PyExc_RuntimeError);
  static py::exception<Error> error(m, "Error", PyExc_RuntimeError);
  error_type = error;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      try {
        raise(e);
      } catch (py::error_already_set& set) {
        set.restore();
      }
    }
  });
  m.def("_shutdown", [] {
    py::gil_scoped_release unlocked;
    std::lock_guard loop_lock(loop_mutex);
    if (forked_away(loop_pid)) return;  // the parent's Loop and streams: not this process's to end
    {
      std::lock_guard lock(streams_mutex);
      streams.clear();
    }
    delete the_loop;
    the_loop = nullptr;
  });

  py::class_<DeviceArray>(m, "DeviceArray")
      .def_static("empty", &DeviceArray::empty, py::arg("shape"), py::arg("dtype"), py::arg("device") = 0)
      .def_static("from_host", &DeviceArray::from_host, py::arg("x"), py::arg("device") = 0)
      .def("to_host", &DeviceArray::to_host)
      .def("copy", &DeviceArray::clone)
      .def_property_readonly("shape", &DeviceArray::shape)
      .def_property_readonly("dtype", &DeviceArray::dtype)
      .def_property_readonly("device", &DeviceArray::device)
      .def_property_readonly("size", &DeviceArray::size)
      .def_property_readonly("ndim", &DeviceArray::ndim)
      .def("__dlpack__", &DeviceArray::dlpack, py::arg("stream") = py::none())
      .def("__dlpack_device__", &DeviceArray::dlpack_device)
      .def_static("_from_dlpack", &DeviceArray::from_dlpack)
      .def("__repr__", &DeviceArray::repr);
  // The output shapes of the axis collectives (weft/tensor.hpp), for the Python half's allocations.
  m.def("all_gather_shape", [](const std::vector<std::size_t>& shape, int axis, int ranks, bool tiled) {
    return weft::all_gather_shape(shape, axis, ranks, tiled);
  });
  m.def("reduce_scatter_shape", [](const std::vector<std::size_t>& shape, int axis, int ranks, bool tiled) {
    return weft::reduce_scatter_shape(shape, axis, ranks, tiled);
  });
  m.def("all_to_all_shape", [](const std::vector<std::size_t>& shape, int split_axis, int concat_axis, int ranks, bool tiled) {
    return weft::all_to_all_shape(shape, split_axis, concat_axis, ranks, tiled);
  });
  m.attr("version") = std::string(weft::version());
  m.def("available_algorithms", [](const std::string& collective) {
    if (!collective_named(collective)) raise_invalid("available_algorithms: '" + collective + "' is not a collective");
    const auto& names = algorithms::available_algorithms(collective);
    return std::vector<std::string>(names.begin(), names.end());
  });
  m.def("plan", [](const std::string& name, int size, int rank, std::size_t count, int root) {
    return steps_of(built_plan(name, size, rank, count, root));
  });
  m.attr("plan_builders") = plan_builders;
  m.def("blocks_of", [](std::size_t count, int parts) {
    if (parts < 1) raise_invalid(fmt::format("blocks_of: parts {} must be at least 1", parts));
    std::vector<std::pair<std::size_t, std::size_t>> out;
    for (const auto& b : algorithms::blocks_of(count, parts)) out.emplace_back(b.offset, b.count);
    return out;
  });
  m.def("device_backend", [] { return std::string(gpu::backend_name()); });
  m.def("device_count", [] { return gpu::device_count(); });

  py::class_<Work>(m, "Work")
      .def_property_readonly("id", &Work::id)
      .def("done", &Work::done)
      .def("result", &Work::result)
      .def("wait", &Work::wait)
      .def("wait_for", &Work::wait_for, py::arg("seconds"))
      .def("spin", &Work::spin, py::arg("microseconds"))
      .def("cancel", &Work::cancel);

  using G = PyGroup;
  py::class_<G>(m, "Group")
      .def_static("create", &G::create)
      .def_property_readonly("rank", &G::rank)
      .def_property_readonly("size", &G::size)
      .def_property_readonly("transport", &G::transport)
      .def_property_readonly("has_shared_arena", &G::has_shared_arena)
      .def_property_readonly("fd", &G::fd)
      .def_property_readonly("closed", &G::closed)
      .def_property_readonly("in_flight", &G::in_flight)
      .def("reap", &G::reap)
      .def("arm", &G::arm)
      .def("clear_wakeup", &G::clear_wakeup)
      .def("close", &G::close)
      .def("split", &G::split)
      .def("abort", &G::abort, py::arg("reason") = "")
      .def("shrink", &G::shrink)
      .def("with_timeout", &G::with_timeout)
      .def("transport_to", &G::transport_to)
      .def("override_algorithms", &G::override_algorithms)
      .def("algorithm_for", &G::algorithm_for)
      // ---- over n-d arrays (weft/tensor.hpp); `out` is allocated by the Python half
      .def("all_reduce", [](G& g, py::object in, py::object out, const std::string& op) {
        const ReduceOp o = op_named(op);
        return g.start(out, py::make_tuple(in, out), [&](Group& gr) {
          // C-contiguous arrays of one shape (the common case) skip the n-d layer.
          if (!on_device(in) && !on_device(out)) {
            const auto i = in.cast<py::array>(), u = out.cast<py::array>();
            const bool flat_arrays = (i.flags() & u.flags() & py::array::c_style) && i.ndim() == u.ndim() &&
                                     std::equal(i.shape(), i.shape() + i.ndim(), u.shape());
            if (flat_arrays) return gr.all_reduce(const_flat(in, "x"), flat(out, "out"), o);
          }
          return weft::all_reduce(gr, const_view(in), mutable_view(out), o);
        });
      })
      .def("broadcast", [](G& g, py::object x, int root) {
        return g.start(x, py::make_tuple(x), [&](Group& gr) { return weft::broadcast(gr, mutable_view(x), root); });
      })
      .def("all_gather", [](G& g, py::object in, py::object out, int axis, bool tiled, Counts extents) {
        return g.start(out, py::make_tuple(in, out),
                       [&](Group& gr) { return weft::all_gather(gr, const_view(in), mutable_view(out), axis, tiled, extents); });
      })
      .def("reduce_scatter", [](G& g, py::object in, py::object out, int axis, const std::string& op, bool tiled, Counts extents) {
        const ReduceOp o = op_named(op);
        return g.start(out, py::make_tuple(in, out),
                       [&](Group& gr) { return weft::reduce_scatter(gr, const_view(in), mutable_view(out), axis, o, tiled, extents); });
      })
      .def("all_to_all", [](G& g, py::object in, py::object out, int split_axis, int concat_axis, bool tiled) {
        return g.start(out, py::make_tuple(in, out), [&](Group& gr) {
          return weft::all_to_all(gr, const_view(in), mutable_view(out), split_axis, concat_axis, tiled);
        });
      })
      .def("ppermute", [](G& g, py::object in, py::object out, Pairs pairs) {
        return g.start(out, py::make_tuple(in, out),
                       [&](Group& gr) { return weft::permute(gr, const_view(in), mutable_view(out), pairs); });
      })
      // ---- over flat C-contiguous arrays (the buffer collectives)
      .def("reduce", [](G& g, py::object in, py::object out, int root, const std::string& op) {
        const ReduceOp o = op_named(op);
        return g.start(out, py::make_tuple(in, out), [&](Group& gr) {
          BufferView o_view;
          if (!out.is_none()) {
            o_view = flat(out, "out");
          }
          return gr.reduce(const_flat(in, "x"), o_view, root, o);
        });
      })
      .def("gather", [](G& g, py::object in, py::object out, int root) {
        return g.start(out, py::make_tuple(in, out), [&](Group& gr) {
          BufferView o_view;
          if (!out.is_none()) {
            o_view = flat(out, "out");
          }
          return gr.gather(const_flat(in, "x"), o_view, root);
        });
      })
      .def("scatter", [](G& g, py::object in, py::object out, int root) {
        return g.start(out, py::make_tuple(in, out), [&](Group& gr) {
          ConstBufferView i_view;
          if (!in.is_none()) i_view = const_flat(in, "x");
          return gr.scatter(i_view, flat(out, "out"), root);
        });
      })
      .def("barrier", [](G& g) { return g.start(py::none(), py::none(), [&](Group& gr) { return gr.barrier(); }); })
      .def("send", [](G& g, py::object x, int dst, std::uint32_t tag) {
        return g.start(py::none(), py::make_tuple(x), [&](Group& gr) { return gr.send(const_flat(x, "x"), dst, tag); });
      })
      .def("recv", [](G& g, py::object out, int src, std::uint32_t tag) {
        return g.start(out, py::make_tuple(out), [&](Group& gr) { return gr.recv(flat(out, "out"), src, tag); });
      })
      // ---- variable-size, over flat arrays
      .def("all_gatherv", [](G& g, py::object in, py::object out, Counts counts, Counts displs) {
        return g.start(out, py::make_tuple(in, out),
                       [&](Group& gr) { return gr.all_gatherv(const_flat(in, "x"), flat(out, "out"), counts, displs); });
      })
      .def("gatherv", [](G& g, py::object in, py::object out, Counts counts, int root, Counts displs) {
        return g.start(out, py::make_tuple(in, out), [&](Group& gr) {
          BufferView o_view;
          if (!out.is_none()) {
            o_view = flat(out, "out");
          }
          return gr.gatherv(const_flat(in, "x"), o_view, counts, root, displs);
        });
      })
      .def("scatterv", [](G& g, py::object in, py::object out, Counts counts, int root, Counts displs) {
        return g.start(out, py::make_tuple(in, out), [&](Group& gr) {
          ConstBufferView i_view;
          if (!in.is_none()) i_view = const_flat(in, "x");
          return gr.scatterv(i_view, flat(out, "out"), counts, root, displs);
        });
      })
      .def("all_to_allv", [](G& g, py::object in, py::object out, Counts send_counts, Counts recv_counts, Counts send_displs,
                             Counts recv_displs) {
        return g.start(out, py::make_tuple(in, out), [&](Group& gr) {
          return gr.all_to_allv(const_flat(in, "x"), flat(out, "out"), send_counts, recv_counts, send_displs, recv_displs);
        });
      })
      .def("reduce_scatterv", [](G& g, py::object in, py::object out, Counts counts, const std::string& op) {
        const ReduceOp o = op_named(op);
        return g.start(out, py::make_tuple(in, out),
                       [&](Group& gr) { return gr.reduce_scatterv(const_flat(in, "x"), flat(out, "out"), counts, o); });
      })
      // ---- a plan of the caller's (host arrays: a plan's steps read and write the buffers directly)
      .def("run_plan", [](G& g, const std::vector<StepTuple>& steps, py::object in, py::object out, const std::string& op,
                          const std::string& name) {
        const ReduceOp o = op_named(op);
        const ConstBufferView x = const_flat(in, "x");
        const BufferView y = flat(out, "out");
        if (x.dtype != y.dtype) {
          raise_invalid(fmt::format("run_plan: x is {} and out {}: a plan moves elements of one dtype", to_string(x.dtype), to_string(y.dtype)));
        }
        auto plan = plan_of(steps, x.count, y.count);
        const char* kept = plan_name(name);
        return g.start(out, py::make_tuple(in, out), [&](Group& gr) {
          return gr.run_plan(std::move(plan), algorithms::PlanBuffers{static_cast<const std::byte*>(x.data), static_cast<std::byte*>(y.data),
                                                                       x.dtype, o},
                             kept);
        });
      });
}
