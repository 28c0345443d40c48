// Pinned host memory for the emulated GPUs: the one piece of the PrivateUse1
// backend torch takes only from C++.
//
// torch asks the accelerator's hooks (PrivateUse1HooksInterface) for a pinned
// host allocator (Tensor.pin_memory(), torch.empty(pin_memory=True), DDP's
// reducer copying its map of used parameters) and whether a pointer came from
// it (Tensor.is_pinned(), and the reducer asserts it). The hooks registered
// from Python (torch._C._acc.PrivateUse1Hooks) forward neither, so shim/memory/pinned.py
// loads this library and registers these hooks in their place, before
// torch.utils.backend_registration would register the Python ones.
//
// "Pinned" memory here is ordinary host memory, as a copy to an emulated GPU
// is a host memcpy; what matters is that torch sees it as pinned, from any
// thread (a DataLoader's pin-memory thread included).
//
// Built by shim/native/build.py as a plain shared library (no Python, no
// pybind11, to keep the compile short); its entry point is called via ctypes.

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstddef>
#include <mutex>
#include <unordered_set>

namespace {

// Which allocations are pinned: is_pinned() asks about a storage's base
// pointer, which is exactly what allocate() handed out.
struct Live {
  std::mutex mutex;
  std::unordered_set<const void*> ptrs;
};

Live& live() {
  static auto* registry = new Live();  // never destroyed: tensors freed during exit still find it
  return *registry;
}

void free_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(live().mutex);
    live().ptrs.erase(ptr);
  }
  c10::free_cpu(ptr);
}

struct PinnedHostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = c10::alloc_cpu(nbytes);  // nullptr for 0 bytes, as the CPU allocator gives
    if (ptr != nullptr) {
      std::lock_guard<std::mutex> lock(live().mutex);
      live().ptrs.insert(ptr);
    }
    return {ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &free_pinned;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

// What the Python hooks of torch.utils.backend_registration answer (built,
// available, a context on every device), plus the pinned allocator.
struct MirageHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }

  bool isAvailable() const override {
    return true;
  }

  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override {
    return true;
  }

  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(live().mutex);
    return live().ptrs.count(data) != 0;
  }

  at::Allocator* getPinnedMemoryAllocator() const override {
    static auto* allocator = new PinnedHostAllocator();  // torch keeps the pointer for the process's life
    return allocator;
  }
};

} // namespace

// 1 when these hooks are now PrivateUse1's, 0 when other hooks got there first
// (torch takes hooks once per process).
extern "C" int mirage_register_pinned_host() {
  if (at::isPrivateUse1HooksRegistered()) {
    return 0;
  }
  at::RegisterPrivateUse1HooksInterface(new MirageHooks());
  return 1;
}
