// What ProcessGroupNCCL and DDP's reducer do in C++ that a Python process group cannot reach from Python:
//
// * the profiler's view of a collective: the async event titled "nccl:<op>" that c10d's Work opens
//   with the call's input tensors and closes when the work completes, and the "record_param_comms"
//   event (RECORD_PARAM_COMMS_DATA) that carries the collective's metadata into Kineto's trace;
// * a DDP timer for the emulated device (PrivateUse1): the reducer takes its timer from c10d's
//   TimerRegistry by device type and only CPU and CUDA register one, so DDP's logging data had no
//   forward/backward/communication times and warned. Kernels of an emulated GPU run on the host
//   before the call returns, so host time is what a CUDA event would measure there.
//
// Plain C entry points (ctypes): tensors arrive as TensorImpl addresses (Tensor._cdata).

#include <ATen/Tensor.h>
#include <ATen/record_function.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>

#include <memory>
#include <string>
#include <vector>

namespace c10d {
namespace {

class MirageTimer : public Timer {
 public:
  explicit MirageTimer(c10::Device /* unused */) {}

  // as CpuTimer: an event not recorded this iteration (or out of order) gives no figure
  std::optional<int64_t> measureDifference(Event start, Event end) override {
    int64_t start_time = getTimeRef(start);
    int64_t end_time = getTimeRef(end);
    if (start_time == kUnsetTime || end_time == kUnsetTime || end_time < start_time) {
      return std::nullopt;
    }
    return end_time - start_time;
  }
};

} // namespace

C10_REGISTER_TYPED_CLASS(TimerRegistry, c10::kPrivateUse1, MirageTimer);

} // namespace c10d

namespace {

std::vector<at::Tensor> tensors(const int64_t* impls, int n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (int i = 0; i < n; ++i) {
    out.emplace_back(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim_copy(
        reinterpret_cast<c10::TensorImpl*>(impls[i])));
  }
  return out;
}

std::vector<int64_t> ints(const int64_t* values, int n) {
  return std::vector<int64_t>(values, values + n);
}

} // namespace

extern "C" {

// Open the async event ``title`` with the call's inputs, as c10d's Work constructor does; a handle
// for mirage_work_end, or null when no profiler listens.
void* mirage_work_begin(const char* title, const int64_t* impls, int n) {
  try {
    auto rf = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (!rf->isActive()) {
      return nullptr;
    }
    // a work may complete on another thread than the one that posted it
    rf->_setAsync();
    if (rf->needsInputs()) {
      std::vector<c10::IValue> inputs;
      for (auto& t : tensors(impls, n)) {
        inputs.emplace_back(std::move(t));
      }
      rf->before(title, c10::ArrayRef<const c10::IValue>(inputs.data(), inputs.size()));
    } else {
      rf->before(title);
    }
    return rf.release();
  } catch (...) {
    return nullptr;  // the profile misses an event; the collective itself must not fail for it
  }
}

// Close an event mirage_work_begin opened (the work completed).
void mirage_work_end(void* handle) {
  auto* rf = static_cast<at::RecordFunction*>(handle);
  try {
    rf->end();
  } catch (...) {
  }
  delete rf;
}

// Open "record_param_comms" with the collective's metadata, as RECORD_PARAM_COMMS_DATA does around
// the enqueue; a handle for mirage_param_comms_end, or null when no profiler listens.
struct ParamComms {
  std::shared_ptr<torch::ParamCommsDebugInfo> info;
  std::unique_ptr<c10::DebugInfoGuard> guard;
  std::unique_ptr<at::RecordFunction> rf;
};

void* mirage_param_comms_begin(int64_t seq, const char* pg_name, const char* pg_desc, int rank,
                               const char* coll_name, int64_t in_nelems, int64_t out_nelems, int dtype,
                               const int64_t* in_impls, int n_in, const int64_t* out_impls, int n_out,
                               const int64_t* in_splits, int n_in_splits, const int64_t* out_splits,
                               int n_out_splits, int global_rank_start, int global_rank_stride,
                               int world_size) {
  try {
    auto rf = std::make_unique<at::RecordFunction>(at::RecordScope::FUNCTION);
    if (!rf->isActive()) {
      return nullptr;
    }
    auto pg = std::make_tuple(std::string(pg_name), std::string(pg_desc));
    auto* p = new ParamComms();
    p->info = std::make_shared<torch::ParamCommsDebugInfo>(
        pg, rank, std::string(coll_name), in_nelems, out_nelems, static_cast<at::ScalarType>(dtype),
        ints(in_splits, n_in_splits), ints(out_splits, n_out_splits), global_rank_start, global_rank_stride,
        world_size, true);
    p->info->setSequenceInfo(seq, false);
    p->guard = std::make_unique<c10::DebugInfoGuard>(c10::DebugInfoKind::PARAM_COMMS_INFO, p->info);
    if (rf->needsInputs()) {
      auto ins = tensors(in_impls, n_in);
      auto outs = tensors(out_impls, n_out);
      std::vector<c10::IValue> inputs = {
          c10::IValue(ins), c10::IValue(std::make_tuple(seq, false)), c10::IValue(pg), c10::IValue(rank),
          c10::IValue(std::string(coll_name)), c10::IValue(ints(in_splits, n_in_splits)),
          c10::IValue(ints(out_splits, n_out_splits)), c10::IValue(global_rank_start),
          c10::IValue(global_rank_stride), c10::IValue(world_size), c10::IValue(true)};
      rf->before(at::kParamCommsCallName, c10::ArrayRef<const c10::IValue>(inputs.data(), inputs.size()));
      if (rf->needsOutputs()) {
        rf->setOutputs(std::vector<c10::IValue>(1, c10::IValue(outs)));
      }
    } else {
      rf->before(at::kParamCommsCallName);
    }
    p->rf = std::move(rf);
    return p;
  } catch (...) {
    return nullptr;
  }
}

// Close what mirage_param_comms_begin opened (on the same thread: the debug info is thread-local).
void mirage_param_comms_end(void* handle) {
  auto* p = static_cast<ParamComms*>(handle);
  try {
    p->rf->end();
  } catch (...) {
  }
  p->rf.reset();
  p->guard.reset();
  delete p;
}

} // extern "C"
