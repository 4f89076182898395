// fastrope's mutating ops on CUDA tensors in C++: the launches planned for an input geometry,
// made again with no Python.
//
// A compiled graph calls fastrope::rope_ (in place) and fastrope::rope_out (into outputs the
// graph allocated) through the dispatcher at every run. With Python kernels each call pays for
// Python inside the op call: the key, the lookup and the launch took 20-22 us more than a
// compiled t.add_(0) on an H100, where the op boundary alone costs less than that trivial op
// (results/README.md, "fastrope's host cost, call by call"). These kernels, registered at the
// CUDA key, do the per-call work in C++:
//
//  * the key: every argument's value, and every tensor's dtype, device, sizes and strides, with
//    the OR of the data pointers' low 4 bits and whether k is q (a superset of
//    problem.input_key, so one key is one validated problem and one plan); the int `offset`
//    enters as zero or not, as in Python;
//  * a hit: the pointers packed after the plan's per-problem bytes (launcher.py's Params), one
//    cuLaunchKernel per planned launch on torch's current stream, in the device's primary
//    context, then the mutated tensors' version counters bumped;
//  * a miss, or a call its entry cannot replay: the Python implementation, registered as
//    fastrope::plan_rope_ / plan_rope_out (ops.py), which validates, plans and launches as
//    before and returns the launches as words (run.replay_words) when calls of this key may be
//    replayed: tables used as given or angles computed from fp64 frequencies, nothing for
//    check_positions to read. Calls whose entry holds no launches always go to Python.
//
// Per call the hit path also refuses, and sends to Python (which raises or handles it), an
// out-of-place call whose outputs overlap an input or each other, and an inverse rotation with
// k sharing q's memory.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <dlfcn.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// The words run.replay_words returns; the first word is this format's number.
constexpr int64_t kFormat = 1;
// Params: 9 pointers and the int64 offset, then the per-problem bytes (264 bytes at most).
constexpr size_t kDynamicBytes = 10 * sizeof(uint64_t);
constexpr size_t kMaxParamsBytes = 512;
constexpr size_t kCacheLimit = 1024;  // as run._CACHE_LIMIT: a full cache is emptied

struct Driver {
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                     unsigned, CUstream, void**, void**);
  CUresult (*get_current)(CUcontext*);
  CUresult (*set_current)(CUcontext);
};

// The driver's entry points, from the libcuda.so.1 torch has loaded.
const Driver& driver() {
  static const Driver d = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    TORCH_CHECK(lib != nullptr, "fastrope: cannot open libcuda.so.1: ", dlerror());
    Driver found{};
    found.launch = reinterpret_cast<decltype(found.launch)>(dlsym(lib, "cuLaunchKernel"));
    found.get_current =
        reinterpret_cast<decltype(found.get_current)>(dlsym(lib, "cuCtxGetCurrent"));
    found.set_current =
        reinterpret_cast<decltype(found.set_current)>(dlsym(lib, "cuCtxSetCurrent"));
    TORCH_CHECK(found.launch && found.get_current && found.set_current,
                "fastrope: libcuda.so.1 lacks cuLaunchKernel, cuCtxGetCurrent or cuCtxSetCurrent");
    return found;
  }();
  return d;
}

void check(CUresult status, const char* what) {
  TORCH_CHECK(status == CUDA_SUCCESS, "fastrope: ", what, " failed (CUresult ",
              static_cast<int>(status), ")");
}

// Makes `context` current for the scope when it is not (a thread that made no CUDA call, such
// as autograd's backward thread, has none), and restores the thread's own afterwards.
class ContextScope {
 public:
  explicit ContextScope(CUcontext context) {
    check(driver().get_current(&previous_), "cuCtxGetCurrent");
    if (previous_ != context) {
      check(driver().set_current(context), "cuCtxSetCurrent");
      switched_ = true;
    }
  }
  ~ContextScope() {
    if (switched_) driver().set_current(previous_);
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  CUcontext previous_ = nullptr;
  bool switched_ = false;
};

struct Launch {
  CUfunction function;
  unsigned grid[3];
  unsigned block[3];
  unsigned shared_mem;
  int a, b;                       // which inputs (0: q, 1: k) it rotates; b < 0: one
  std::vector<int64_t> statics;   // the per-problem bytes, as little-endian words
};

enum class Frequencies : int64_t { kNone = 0, kGiven = 1, kKept = 2 };

struct Entry {
  int device;
  CUcontext context;
  Frequencies frequencies;
  std::vector<int64_t> spans;  // out of place: each input's and output's byte extent
  std::vector<Launch> launches;
  at::Tensor kept;             // the default fp64 frequencies the launches read
};

// Where each argument sits in an op's schema (both ops name theirs alike).
struct Signature {
  size_t count;
  int q, k, q_out, k_out, cos, sin, positions, offsets, offset, cu_seqlens, inv_freq, inverse;
  c10::OperatorHandle plan;  // the Python implementation

  Signature(const c10::FunctionSchema& schema, const char* plan_name)
      : plan(c10::Dispatcher::singleton().findSchemaOrThrow(plan_name, "")) {
    const auto& args = schema.arguments();
    count = args.size();
    auto at = [&](const char* name) {
      for (size_t i = 0; i < args.size(); ++i)
        if (args[i].name() == name) return static_cast<int>(i);
      return -1;
    };
    q = at("q"), k = at("k"), q_out = at("q_out"), k_out = at("k_out"), cos = at("cos");
    sin = at("sin"), positions = at("positions"), offsets = at("offsets");
    offset = at("offset"), cu_seqlens = at("cu_seqlens"), inv_freq = at("inv_freq");
    inverse = at("inverse");
    TORCH_CHECK(q == 0 && k == 1 && cos >= 0 && sin >= 0 && positions >= 0 && offsets >= 0 &&
                    offset >= 0 && cu_seqlens >= 0 && inv_freq >= 0,
                "fastrope: unexpected schema ", schema);
  }
};

using Key = std::vector<int64_t>;

struct KeyHash {
  size_t operator()(const Key& key) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : key) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

struct Cache {
  std::mutex mutex;
  std::unordered_map<Key, std::shared_ptr<const Entry>, KeyHash> entries;
};

std::atomic<int64_t> replayed{0}, planned{0};

constexpr int64_t kNoneWord = INT64_MIN;

uint64_t address(const at::Tensor& t) {
  return reinterpret_cast<uint64_t>(t.data_ptr());
}

uint64_t address_or_zero(const c10::IValue& v) {
  return v.isTensor() && v.toTensor().defined() ? address(v.toTensor()) : 0;
}

// The call's key; false where the call is not cacheable (an argument of another kind, a
// tensor that is not strided).
bool make_key(const Signature& sig, c10::ArrayRef<c10::IValue> args, Key& key) {
  key.reserve(96);
  uint64_t low_bits = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = args[i];
    if (v.isNone()) {
      key.push_back(kNoneWord);
    } else if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        key.push_back(kNoneWord);
        continue;
      }
      if (t.layout() != c10::kStrided) return false;
      key.push_back(static_cast<int64_t>(t.scalar_type()));
      key.push_back(static_cast<int64_t>(t.device().type()));
      key.push_back(t.device().index());
      key.push_back(t.dim());
      for (int64_t n : t.sizes()) key.push_back(n);
      for (int64_t s : t.strides()) key.push_back(s);
      low_bits |= address(t);
    } else if (static_cast<int>(i) == sig.offset) {
      key.push_back(v.toInt() != 0);
    } else if (v.isInt()) {
      key.push_back(v.toInt());
    } else if (v.isDouble()) {
      double d = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &d, sizeof(bits));
      key.push_back(bits);
    } else if (v.isBool()) {
      key.push_back(v.toBool());
    } else if (v.isString()) {
      const std::string& s = v.toStringRef();
      key.push_back(static_cast<int64_t>(s.size()));
      for (size_t j = 0; j < s.size(); j += 8) {
        int64_t word = 0;
        std::memcpy(&word, s.data() + j, std::min<size_t>(8, s.size() - j));
        key.push_back(word);
      }
    } else {
      return false;
    }
  }
  key.push_back(static_cast<int64_t>(low_bits & 15));
  const c10::IValue& k = args[sig.k];
  key.push_back(k.isTensor() && k.toTensor().defined() &&
                address(k.toTensor()) == address(args[sig.q].toTensor()));  // k is q
  return true;
}

// An entry from run.replay_words's words; null when the words say the key is not replayable.
std::shared_ptr<const Entry> parse(const std::vector<int64_t>& words, const c10::IValue& kept) {
  if (words.empty()) return nullptr;
  size_t i = 0;
  auto next = [&]() {
    TORCH_CHECK(i < words.size(), "fastrope: replay words end early");
    return words[i++];
  };
  TORCH_CHECK(next() == kFormat, "fastrope: replay words of another format");
  auto entry = std::make_shared<Entry>();
  entry->device = static_cast<int>(next());
  entry->context = reinterpret_cast<CUcontext>(static_cast<uintptr_t>(next()));
  entry->frequencies = static_cast<Frequencies>(next());
  for (int64_t n = next(); n > 0; --n) entry->spans.push_back(next());
  for (int64_t n = next(); n > 0; --n) {
    Launch l{};
    l.function = reinterpret_cast<CUfunction>(static_cast<uintptr_t>(next()));
    for (unsigned& g : l.grid) g = static_cast<unsigned>(next());
    for (unsigned& b : l.block) b = static_cast<unsigned>(next());
    l.shared_mem = static_cast<unsigned>(next());
    l.a = static_cast<int>(next());
    l.b = static_cast<int>(next());
    for (int64_t m = next(); m > 0; --m) l.statics.push_back(next());
    TORCH_CHECK(kDynamicBytes + l.statics.size() * 8 <= kMaxParamsBytes,
                "fastrope: replay words carry too many parameter bytes");
    entry->launches.push_back(std::move(l));
  }
  TORCH_CHECK(i == words.size(), "fastrope: replay words run on");
  if (entry->frequencies == Frequencies::kKept) {
    TORCH_CHECK(kept.isTensor(), "fastrope: replay words name kept frequencies but none came");
    entry->kept = kept.toTensor();
  }
  return entry;
}

// Whether no output overlaps an input or another output (run._check_apart).
bool apart(const std::vector<int64_t>& spans, const uint64_t* starts, size_t n) {
  if (spans.size() != n) return false;
  for (size_t i = n / 2; i < n; ++i)
    for (size_t j = 0; j < i; ++j) {
      uint64_t a = starts[i], b = starts[j];
      uint64_t na = static_cast<uint64_t>(spans[i]), nb = static_cast<uint64_t>(spans[j]);
      if (na && nb && a < b + nb && b < a + na) return false;
    }
  return true;
}

// The call made again from its entry; false where this call must go to Python.
bool replay(const Signature& sig, const Entry& e, c10::ArrayRef<c10::IValue> args) {
  const at::Tensor& q = args[sig.q].toTensor();
  const bool has_k = args[sig.k].isTensor() && args[sig.k].toTensor().defined();
  uint64_t xs[2] = {address(q), has_k ? address(args[sig.k].toTensor()) : 0};
  uint64_t outs[2] = {xs[0], xs[1]};
  const bool in_place = sig.q_out < 0;
  if (!in_place) {
    outs[0] = address(args[sig.q_out].toTensor());
    outs[1] = address_or_zero(args[sig.k_out]);
    const size_t n = has_k ? 4 : 2;
    const uint64_t starts[4] = {xs[0], has_k ? xs[1] : outs[0], has_k ? outs[0] : 0, outs[1]};
    if (!apart(e.spans, starts, n)) return false;
    if (sig.inverse >= 0 && args[sig.inverse].toBool() && has_k &&
        args[sig.k].toTensor().numel() && xs[1] == xs[0])
      return false;
  }
  const uint64_t cos = address_or_zero(args[sig.cos]), sin = address_or_zero(args[sig.sin]);
  const uint64_t inv_freq = e.frequencies == Frequencies::kGiven ? address_or_zero(args[sig.inv_freq])
                            : e.frequencies == Frequencies::kKept ? address(e.kept)
                                                                  : 0;
  const uint64_t position_tensor = args[sig.positions].isNone()
                                       ? address_or_zero(args[sig.offsets])
                                       : address_or_zero(args[sig.positions]);
  const uint64_t cu_seqlens = address_or_zero(args[sig.cu_seqlens]);
  const int64_t offset = args[sig.offsets].isNone() ? args[sig.offset].toInt() : 0;
  if (!e.launches.empty()) {
    const CUstream stream = c10::cuda::getCurrentCUDAStream(e.device).stream();
    ContextScope scope(e.context);
    alignas(16) unsigned char params[kMaxParamsBytes];
    for (const Launch& l : e.launches) {
      const uint64_t dynamic[10] = {xs[l.a], l.b >= 0 ? xs[l.b] : 0, outs[l.a],
                                    l.b >= 0 ? outs[l.b] : 0, cos, sin, inv_freq,
                                    position_tensor, cu_seqlens, static_cast<uint64_t>(offset)};
      std::memcpy(params, dynamic, kDynamicBytes);
      std::memcpy(params + kDynamicBytes, l.statics.data(), l.statics.size() * 8);
      void* argv[1] = {params};
      check(driver().launch(l.function, l.grid[0], l.grid[1], l.grid[2], l.block[0], l.block[1],
                            l.block[2], l.shared_mem, stream, argv, nullptr),
            "cuLaunchKernel");
    }
  }
  const c10::IValue& first = in_place ? args[sig.q] : args[sig.q_out];
  const c10::IValue& second = in_place ? args[sig.k] : args[sig.k_out];
  first.toTensor().unsafeGetTensorImpl()->bump_version();
  if (second.isTensor() && second.toTensor().defined())
    second.toTensor().unsafeGetTensorImpl()->bump_version();
  return true;
}

// One op's kernel: replay the key's launches, else plan in Python (and remember the launches).
template <const char* kPlanName>
void rope_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  static const Signature sig(op.schema(), kPlanName);
  static Cache cache;
  auto args = torch::jit::last(*stack, sig.count);
  Key key;
  const bool cacheable = make_key(sig, args, key);
  if (cacheable) {
    std::shared_ptr<const Entry> entry;
    {
      std::lock_guard<std::mutex> lock(cache.mutex);
      auto found = cache.entries.find(key);
      if (found != cache.entries.end()) entry = found->second;
    }
    if (entry && replay(sig, *entry, args)) {
      torch::jit::drop(*stack, sig.count);
      replayed.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  {
    at::AutoDispatchBelowADInplaceOrView below;  // straight to the Python kernel
    sig.plan.callBoxed(stack);
  }
  planned.fetch_add(1, std::memory_order_relaxed);
  c10::IValue kept = torch::jit::pop(*stack);
  std::vector<int64_t> words = torch::jit::pop(*stack).toIntVector();
  if (!cacheable) return;
  std::shared_ptr<const Entry> entry = parse(words, kept);
  if (!entry) return;
  std::lock_guard<std::mutex> lock(cache.mutex);
  if (cache.entries.size() >= kCacheLimit) cache.entries.clear();
  cache.entries[std::move(key)] = std::move(entry);
}

constexpr char kPlanInPlace[] = "fastrope::plan_rope_";
constexpr char kPlanOut[] = "fastrope::plan_rope_out";

// How many calls the C++ kernels replayed and how many went to Python, since the process began.
std::vector<int64_t> replay_counts() {
  return {replayed.load(std::memory_order_relaxed), planned.load(std::memory_order_relaxed)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastrope, m) {
  m.def("replay_counts() -> int[]", &replay_counts);
}

TORCH_LIBRARY_IMPL(fastrope, CUDA, m) {
  m.impl("rope_", torch::CppFunction::makeFromBoxedFunction<&rope_kernel<kPlanInPlace>>());
  m.impl("rope_out", torch::CppFunction::makeFromBoxedFunction<&rope_kernel<kPlanOut>>());
}
