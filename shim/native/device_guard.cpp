// The backend device's guard, in C++: what torch asks of a device many times per op.
//
// torch.utils.backend_registration registers a Python device guard for
// PrivateUse1 (torch._C._acc.DeviceGuard): every call (getDevice,
// exchangeDevice, getStream: autograd asks for a stream for every output it
// records, and every DeviceGuard sets and restores the device) reaches Python
// through pybind11 to ask the guard its type_, about 400 times per
// transformer-block training step. This guard answers the same in C++: one
// device (mirage:0, which every emulated GPU sits on), one default stream that
// is always idle, events that have always completed. The emulated GPUs'
// indices, streams and events live in Python (shim/tensor/wrapper.py, shim/cuda/api.py).
//
// shim/cuda/engine.py loads it (built by shim/native/build.py, like
// pinned_host.cpp: a plain shared library, no Python, no pybind11) and
// registers it before torch.utils.backend_registration would register the
// Python one, which then leaves it in place.
//
// The same guard also answers for DeviceType::CUDA, which a CPU build has no
// guard for. Tensors that C++ sees on a cuda device do exist here: FakeTensors
// and meta-like tensors made with device=t.device while tracing (flex
// attention's score_mod graphs, torch.compile's fake inputs) report cuda:i.
// When autograd records one (its InputMetadata asks the device's guard for a
// stream), the missing guard threw "PyTorch is not linked with support for
// cuda devices" where no exception may leave, and the process aborted.

//
// And the profiler's CUDA stubs, which a CPU build leaves failing: asked to profile CUDA
// (torch.profiler's ProfilerActivity.CUDA, the default when torch.cuda.is_available(), or
// autograd.profiler's use_device="cuda"), a build without CUPTI times each op with CUDA events
// through them, and torch warned "Failed to record CUDA event" with a C++ stack at every op and
// reported no device time. An emulated GPU's kernels run on the host before the op returns, so
// host time is what a CUDA event would measure there (as DDP's timer in comms_native.cpp).

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/ApproximateClock.h>
#include <torch/csrc/profiler/stubs/base.h>

#include <memory>

namespace {

constexpr c10::DeviceType kBackend = c10::DeviceType::PrivateUse1;

// Exactly the answers of torch's PythonDeviceGuard (torch/csrc/acc/Module.cpp),
// without the round trip to Python for type(): one device of type_ (index 0).
struct MirageDeviceGuard final : c10::impl::DeviceGuardImplInterface {
  explicit MirageDeviceGuard(c10::DeviceType type) : type_(type) {}

  c10::Device device() const {
    return c10::Device(type_, 0);
  }

  c10::DeviceType type() const override {
    return type_;
  }

  c10::Device exchangeDevice(c10::Device /*unused*/) const override {
    return device();
  }

  c10::Device getDevice() const override {
    return device();
  }

  void setDevice(c10::Device /*unused*/) const override {}

  void uncheckedSetDevice(c10::Device /*unused*/) const noexcept override {}

  c10::Stream getStream(c10::Device /*unused*/) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, device());
  }

  c10::Stream getNewStream(c10::Device /*unused*/, int /*priority*/ = 0) const override {
    return c10::Stream(c10::Stream::DEFAULT, device());
  }

  c10::Stream exchangeStream(c10::Stream /*unused*/) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, device());
  }

  c10::DeviceIndex deviceCount() const noexcept override {
    return 1;
  }

  void record(void** /*event*/, const c10::Stream& /*stream*/, const c10::DeviceIndex /*device_index*/,
              const c10::EventFlag /*flag*/) const override {}

  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}

  bool queryEvent(void* /*event*/) const override {
    return true;
  }

  void destroyEvent(void* /*event*/, const c10::DeviceIndex /*device_index*/) const noexcept override {}

  bool queryStream(const c10::Stream& /*stream*/) const override {
    return true;
  }

  void synchronizeStream(const c10::Stream& /*stream*/) const override {}

 private:
  c10::DeviceType type_;
};

struct MirageProfilerStubs final : torch::profiler::impl::ProfilerStubs {
  void record(c10::DeviceIndex* device, torch::profiler::impl::ProfilerVoidEventStub* event,
              int64_t* cpu_ns) const override {
    if (device) {
      *device = 0;
    }
    int64_t now = c10::getTime();
    if (cpu_ns) {
      *cpu_ns = now;
    }
    *event = std::make_shared<int64_t>(now);
  }

  // microseconds, as the CUDA stubs answer (cudaEventElapsedTime's milliseconds × 1000)
  float elapsed(const torch::profiler::impl::ProfilerVoidEventStub* event,
                const torch::profiler::impl::ProfilerVoidEventStub* event2) const override {
    auto start = *static_cast<const int64_t*>(event->get());
    auto end = *static_cast<const int64_t*>(event2->get());
    return static_cast<float>(end - start) / 1000.0f;
  }

  // NVTX ranges: torch.cuda.nvtx is answered in Python (shim/cuda/api.py)
  void mark(const char* /*name*/) const override {}
  void rangePush(const char* /*name*/) const override {}
  void rangePop() const override {}

  bool enabled() const override {
    return true;
  }

  void onEachDevice(std::function<void(int)> op) const override {
    op(0);  // C++ sees one device (mirage:0)
  }

  void synchronize() const override {}
};

int register_for(c10::DeviceType type) {
  if (c10::impl::hasDeviceGuardImpl(type)) {
    return 0;
  }
  c10::impl::registerDeviceGuard(type, new MirageDeviceGuard(type));  // torch keeps it for the process's life
  return 1;
}

} // namespace

// 1 when this guard is now PrivateUse1's, 0 when another was registered first
// (the Python one, if backend_registration ran before).
extern "C" int mirage_register_device_guard() {
  return register_for(kBackend);
}

// 1 when this guard now answers for DeviceType::CUDA, 0 when a CUDA build has its own.
extern "C" int mirage_register_cuda_guard() {
  return register_for(c10::DeviceType::CUDA);
}

// Make the profiler's CUDA stubs ours (a CPU build's fail at every call; a CUDA build's would be
// replaced too, but mirage never runs on one).
extern "C" void mirage_register_profiler_stubs() {
  static MirageProfilerStubs stubs;  // torch keeps a pointer for the process's life
  torch::profiler::impl::registerCUDAMethods(&stubs);
}
