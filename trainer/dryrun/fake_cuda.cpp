// Fake CUDA devices for a build of torch without CUDA (the dry run, trainer/dryrun/):
// a device guard, whose device indices and streams are bookkeeping only, and CUDA's
// hooks, for generators and pinned host memory. Fake tensors never touch device memory.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <atomic>
#include <cstdlib>

namespace {
c10::DeviceIndex current_index = 0;  // one per process: a rank sets it once
int device_count() {
  const char* n = std::getenv("SHARDLM_FAKE_CUDA_DEVICES");
  return n ? std::atoi(n) : 8;
}
struct FakeCudaGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice(); setDevice(d); return old;
  }
  c10::Device getDevice() const override { return c10::Device(c10::DeviceType::CUDA, current_index); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.is_cuda(), "fake CUDA guard got ", d);
    TORCH_CHECK(d.index() < device_count(), "CUDA error: invalid device ordinal ", int(d.index()));
    if (d.index() >= 0) current_index = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { if (d.index() >= 0) current_index = d.index(); }
  c10::Stream getStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getNewStream(c10::Device d, int) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count(); }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
};
}
C10_REGISTER_GUARD_IMPL(CUDA, FakeCudaGuardImpl);
extern "C" void fake_cuda_set_device(int index) { current_index = index; }

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/CPUAllocator.h>
#include <ATen/core/Generator.h>
#include <ATen/Tensor.h>
#include <ATen/Functions.h>
#include <mutex>
#include <set>

namespace {
// A CUDA generator that only keeps its seed and offset, as CUDA's Philox generator's state
// does (16 bytes): random kernels on fake tensors never draw from it.
struct FakeCudaGenerator final : public c10::GeneratorImpl {
  uint64_t seed_ = 67280421310721ULL, offset_ = 0;
  explicit FakeCudaGenerator(c10::DeviceIndex i)
      : c10::GeneratorImpl(c10::Device(c10::DeviceType::CUDA, i), c10::DispatchKeySet(c10::DispatchKey::CUDA)) {}
  void set_current_seed(uint64_t s) override { seed_ = s; offset_ = 0; }
  void set_offset(uint64_t o) override { offset_ = o; }
  uint64_t get_offset() const override { return offset_; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override { seed_ = 42; return seed_; }
  void set_state(const c10::TensorImpl& s) override {
    TORCH_CHECK(s.numel() == 16, "RNG state is wrongly sized");
    auto p = static_cast<const uint64_t*>(s.data());
    seed_ = p[0]; offset_ = p[1];
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto t = at::empty({16}, at::kByte);
    auto p = static_cast<uint64_t*>(t.data_ptr());
    p[0] = seed_; p[1] = offset_;
    return t.getIntrusivePtr();
  }
  FakeCudaGenerator* clone_impl() const override {
    auto g = new FakeCudaGenerator(device().index()); g->seed_ = seed_; g->offset_ = offset_; return g;
  }
  static c10::DeviceType device_type() { return c10::DeviceType::CUDA; }
};

std::mutex pinned_mutex;
std::set<const void*> pinned;

void free_pinned(void* p) {
  { std::lock_guard<std::mutex> l(pinned_mutex); pinned.erase(p); }
  std::free(p);
}
// Host memory said to be pinned: plain malloc, remembered so isPinnedPtr can tell.
struct FakePinnedAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = std::malloc(n ? n : 1);
    { std::lock_guard<std::mutex> l(pinned_mutex); pinned.insert(p); }
    return {p, p, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dst, const void* src, std::size_t n) const override { std::memcpy(dst, src, n); }
};
FakePinnedAllocator pinned_allocator;

struct FakeCudaHooks final : public at::CUDAHooksInterface {
  explicit FakeCudaHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  int getNumGPUs() const override { return device_count(); }
  c10::DeviceIndex current_device() const override { return current_index; }
  void setCurrentDevice(c10::DeviceIndex i) const override { current_index = i; }
  c10::DeviceIndex getCurrentDevice() const override { return current_index; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex i) const override { auto o = current_index; current_index = i; return o; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex i) const override { return exchangeDevice(i); }
  bool isPinnedPtr(const void* p) const override { std::lock_guard<std::mutex> l(pinned_mutex); return pinned.count(p) > 0; }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex i) const override {
    static std::vector<at::Generator> gens = [] {
      std::vector<at::Generator> v;
      for (int k = 0; k < device_count(); ++k) v.push_back(at::make_generator<FakeCudaGenerator>(k));
      return v;
    }();
    return gens.at(i < 0 ? current_index : i);
  }
  at::Generator getNewGenerator(c10::DeviceIndex i) const override {
    return at::make_generator<FakeCudaGenerator>(i < 0 ? current_index : i);
  }
  void deviceSynchronize(c10::DeviceIndex) const override {}
};
}
namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", FakeCudaHooks)
}

#include <torch/csrc/distributed/c10d/reducer_timer.hpp>

namespace {
// DDP's reducer times each iteration with a timer of its device type; a CUDA one records
// CUDA events. Here the host clock stands in: the timings DDP logs are not the dry run's.
struct FakeCudaTimer final : public c10d::Timer {
  explicit FakeCudaTimer(c10::Device) {}
  std::optional<int64_t> measureDifference(Event start, Event end) override {
    auto a = getTimestamp(start), b = getTimestamp(end);
    if (!a || !b) return std::nullopt;
    return *b - *a;
  }
};
}
namespace c10d {
C10_REGISTER_TYPED_CLASS(TimerRegistry, c10::kCUDA, FakeCudaTimer)
}
