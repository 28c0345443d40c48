// Ops on emulated cuda tensors without a round trip through Python.
//
// Every aten op on a MirageTensor (shim/tensor/wrapper.py) reaches torch's Python
// dispatch key, whose fallback converts the arguments to Python objects, finds
// __torch_dispatch__, runs it and converts the result back: about 15 us an op
// in a training step, more than many ops take. This library registers kernels
// for the Python key on the ops a training step mostly runs (shim/tensor/fast_dispatch.py
// lists them): the views (view, t, transpose, detach, expand, ...: 102 of the
// 183 dispatches of a transformer-block step) and common functional ops (mm,
// add, clone, softmax, layer norm, their backwards, ...). For exact
// MirageTensors with no TorchDispatchMode active each does what
// __torch_dispatch__'s _fast does: run the op on the wrappers' CPU tensors
// (_elem) and wrap the results as Tensor._make_wrapper_subclass does, with
// _elem, _gpu and _src (a view) or _mem (ALLOCATOR.hold, called in Python) set.
// Anything else (a mode, another subclass such as DTensor, a CPU or second
// GPU's tensor among the arguments, an error from the op or the allocator)
// takes what torch's Python fallback does, so Python sees the same calls, and
// raises the same errors, as without this library. It also offers _new the
// same wrapper for the outputs of the ops it leaves to Python (new_wrapper).
//
// In clocked mode the plain ops are timed here as well: their cost is found by the op's signature
// (dtypes, sizes, strides, arguments) in a table that the Python roofline fills on a miss, and
// the rank's clock advanced by it (Clock.charge_priced), instead of __torch_dispatch__ and
// Clock.charge pricing every op afresh in Python.
//
// shim/tensor/fast_dispatch.py builds it (shim/native/build.py: it needs Python's and
// libtorch_python's headers) and registers it once shim/tensor/wrapper.py exists.

#include <Python.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/PyInterpreterHooks.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/MemoryFormat.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

namespace {

// The keys above Python (autograd, ADInplaceOrView, functionalization, ...): torch's Python
// fallback excludes them while __torch_dispatch__ runs, so that an op on the CPU tensor inside
// goes straight to its kernel. The same set as in aten/src/ATen/core/PythonFallbackKernel.cpp.
constexpr c10::DispatchKeySet kAbovePython = c10::DispatchKeySet(c10::DispatchKeySet::FULL) ^
    (c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Python) |
     c10::DispatchKeySet(c10::DispatchKey::Python));

PyTypeObject* g_wrapper_type = nullptr;  // shim.tensor.wrapper.MirageTensor
PyObject* g_allocating = nullptr;        // shim.device.state._alloc: .gpu overrides the output's GPU
PyObject* g_elem = nullptr;              // interned attribute names
PyObject* g_gpu = nullptr;
PyObject* g_src = nullptr;
PyObject* g_override = nullptr;
PyObject* g_mem = nullptr;
PyObject* g_hold = nullptr;  // ALLOCATOR.hold(elem, gpu) -> the allocator's key (shim/memory/allocator.py)
torch::Library* g_library = nullptr;  // kept for the process's life: it owns the registrations

// What torch's Python fallback does (PythonFallbackKernel.cpp, pythonFallback): the innermost
// TorchDispatchMode's __torch_dispatch__, else the tensors' own; without a Python tensor (a
// mode put the Python key in the thread's included set and is gone), the kernels below Python.
void python_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard exclude(kAbovePython);
  const auto num_arguments = op.schema().arguments().size();
  const auto modes = c10::impl::TorchDispatchModeTLS::stack_len();
  if (modes > 0) {
    RECORD_FUNCTION("PythonDispatchMode", torch::jit::last(*stack, num_arguments));
    c10::impl::TorchDispatchModeTLS::get_stack_at(modes - 1)->pyinterpreter()->dispatch(op, stack);
    return;
  }
  RECORD_FUNCTION("PythonSubclass", torch::jit::last(*stack, num_arguments));
  bool python_tensor = false;
  for (const auto& ivalue : torch::jit::last(*stack, num_arguments)) {
    if (ivalue.isTensor() && ivalue.unsafeToTensorImpl()->key_set().has(c10::DispatchKey::Python)) {
      python_tensor = true;  // the ops registered take no lists of tensors to look through
    }
  }
  if (python_tensor) {
    (*c10::impl::getGlobalPyInterpreter())->dispatch(op, stack);
    return;
  }
  auto local = c10::impl::tls_local_dispatch_key_set();
  c10::impl::ForceDispatchKeyGuard no_python(local.included_.remove(c10::DispatchKey::Python), local.excluded_);
  op.redispatchBoxed(keys.remove(c10::DispatchKey::Python), stack);
}

// The GIL released for the scope (exceptions included).
struct NoGil {
  PyThreadState* state;
  NoGil() : state(PyEval_SaveThread()) {}
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;
  ~NoGil() {
    PyEval_RestoreThread(state);
  }
};

// A strong reference released at the end of the scope.
struct Ref {
  PyObject* p;
  explicit Ref(PyObject* obj) : p(obj) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  ~Ref() {
    Py_XDECREF(p);
  }
};

// Clocked mode (both nullptr in functional mode): the plain ops are timed here too, from a cache of their
// costs. g_cost(func, args, kwargs, out) -> OpCost prices an op the cache has not seen (shim/clock/roofline.py's
// op_cost); g_charge(gpu, func, cost, inputs) advances the rank's clock by it (Clock.charge_priced).
PyObject* g_cost = nullptr;
PyObject* g_charge = nullptr;
std::unordered_map<const c10::FunctionSchema*, PyObject*> g_funcs;  // the plain ops' OpOverload objects

// What an op's cost depends on: the op, every tensor's dtype, sizes and strides (inputs and outputs),
// every other argument's value. Compared whole, so two signatures never share a cost.
using Signature = std::vector<int64_t>;
struct SignatureHash {
  size_t operator()(const Signature& key) const {
    size_t h = key.size();
    for (int64_t v : key) {
      h ^= std::hash<int64_t>{}(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    }
    return h;
  }
};
std::unordered_map<Signature, PyObject*, SignatureHash> g_costs;  // signature -> OpCost (a strong reference)
constexpr size_t kMaxCosts = 1 << 16;  // a program whose shapes never repeat starts the table afresh past this

enum Tag : int64_t { kTensor = 1, kUndefined, kNone, kInt, kDouble, kBool, kString, kIntList, kOther, kSameTensor };

void add_tensor(Signature& key, const at::Tensor& t) {
  if (!t.defined()) {
    key.push_back(kUndefined);
    return;
  }
  key.push_back(kTensor);
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(t.is_cpu() ? 1 : 0);  // a 0-dim CPU scalar beside the GPU's tensors
  key.push_back(t.dim());
  for (auto size : t.sizes()) {
    key.push_back(size);
  }
  for (auto stride : t.strides()) {
    key.push_back(stride);
  }
}

void add_double(Signature& key, double d) {
  int64_t bits = 0;
  std::memcpy(&bits, &d, sizeof bits);
  key.push_back(kDouble);
  key.push_back(bits);
}

// False for an argument the signature cannot hold (the op is then timed by the Python path). `seen`: the
// tensors met so far in this call, so that `x + x` (which reads x once) and `x + y` differ.
bool add_value(Signature& key, const c10::IValue& v, std::vector<const c10::TensorImpl*>& seen) {
  if (v.isTensor() && v.toTensor().defined() && v.toTensor().unsafeGetTensorImpl()->is_wrapped_number()) {
    // a Python number the op was given (x * 2.0): the fallback hands it back as one, which reads no bytes
    const c10::Scalar number = v.toTensor().item();
    if (number.isComplex()) {
      return false;
    }
    add_double(key, number.toDouble());
    key.push_back(static_cast<int64_t>(number.type()));
  } else if (v.isTensor()) {
    const c10::TensorImpl* impl = v.toTensor().defined() ? v.toTensor().unsafeGetTensorImpl() : nullptr;
    const auto found = std::find(seen.begin(), seen.end(), impl);
    if (impl != nullptr && found != seen.end()) {
      key.push_back(kSameTensor);
      key.push_back(found - seen.begin());
    } else {
      if (impl != nullptr) {
        seen.push_back(impl);
      }
      add_tensor(key, v.toTensor());
    }
  } else if (v.isNone()) {
    key.push_back(kNone);
  } else if (v.isBool()) {
    key.push_back(kBool);
    key.push_back(v.toBool());
  } else if (v.isInt()) {
    key.push_back(kInt);
    key.push_back(v.toInt());
  } else if (v.isDouble()) {
    add_double(key, v.toDouble());
  } else if (v.isString()) {
    const auto& text = v.toStringRef();
    key.push_back(kString);
    key.push_back(static_cast<int64_t>(text.size()));
    for (char c : text) {
      key.push_back(c);
    }
  } else if (v.isIntList()) {
    const auto list = v.toIntList();
    key.push_back(kIntList);
    key.push_back(static_cast<int64_t>(list.size()));
    for (int64_t x : list) {
      key.push_back(x);
    }
  } else {
    return false;
  }
  return true;
}

// An argument as torch's Python fallback hands it to __torch_dispatch__ (a new reference; nullptr with
// no exception set for a type not handled). `wrapper`: the emulated tensor the argument was, if it was one.
PyObject* to_python(const c10::IValue& v, PyObject* wrapper) {
  if (wrapper != nullptr) {
    Py_INCREF(wrapper);
    return wrapper;
  }
  if (v.isTensor() && v.toTensor().defined() && v.toTensor().unsafeGetTensorImpl()->is_wrapped_number()) {
    const c10::Scalar number = v.toTensor().item();  // as torch's fallback hands a Python number on
    if (number.isBoolean()) {
      return PyBool_FromLong(number.toBool());
    }
    if (number.isIntegral(/*includeBool=*/false)) {
      return PyLong_FromLongLong(number.toLong());
    }
    return number.isFloatingPoint() ? PyFloat_FromDouble(number.toDouble()) : nullptr;
  }
  if (v.isTensor()) {
    return v.toTensor().defined() ? THPVariable_Wrap(v.toTensor()) : Py_NewRef(Py_None);
  }
  if (v.isNone()) {
    return Py_NewRef(Py_None);
  }
  if (v.isBool()) {
    return PyBool_FromLong(v.toBool());
  }
  if (v.isInt()) {
    return PyLong_FromLongLong(v.toInt());
  }
  if (v.isDouble()) {
    return PyFloat_FromDouble(v.toDouble());
  }
  if (v.isString()) {
    return PyUnicode_FromStringAndSize(v.toStringRef().data(), static_cast<Py_ssize_t>(v.toStringRef().size()));
  }
  if (v.isIntList()) {
    const auto list = v.toIntList();
    PyObject* out = PyList_New(static_cast<Py_ssize_t>(list.size()));
    for (size_t i = 0; out != nullptr && i < list.size(); ++i) {
      PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), PyLong_FromLongLong(list[i]));
    }
    return out;
  }
  return nullptr;
}

// The cost of `op` from the cache, or priced by g_cost (args/kwargs split as torch's fallback splits
// them); a borrowed reference, nullptr when it cannot be had (then the Python path times the op).
PyObject* cost_of(const c10::OperatorHandle& op, Signature&& key, const std::vector<c10::IValue>& args,
                  const std::vector<PyObject*>& wrappers, const std::vector<c10::IValue>& outs, PyObject* func) {
  auto found = g_costs.find(key);
  if (found != g_costs.end()) {
    return found->second;
  }
  const auto& schema = op.schema().arguments();
  Ref positional(PyList_New(0));
  Ref kwargs(PyDict_New());
  if (positional.p == nullptr || kwargs.p == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < args.size(); ++i) {
    Ref value(to_python(args[i], wrappers[i]));
    if (value.p == nullptr) {
      return nullptr;
    }
    if (schema[i].kwarg_only()) {
      if (PyDict_SetItemString(kwargs.p, schema[i].name().c_str(), value.p) != 0) {
        return nullptr;
      }
    } else if (PyList_Append(positional.p, value.p) != 0) {
      return nullptr;
    }
  }
  Ref positional_tuple(PyList_AsTuple(positional.p));
  Ref out(outs.size() == 1 ? to_python(outs[0], nullptr) : PyTuple_New(static_cast<Py_ssize_t>(outs.size())));
  if (positional_tuple.p == nullptr || out.p == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; outs.size() > 1 && i < outs.size(); ++i) {
    PyObject* item = to_python(outs[i], nullptr);
    if (item == nullptr) {
      return nullptr;
    }
    PyTuple_SET_ITEM(out.p, static_cast<Py_ssize_t>(i), item);
  }
  PyObject* cost = PyObject_CallFunctionObjArgs(g_cost, func, positional_tuple.p, kwargs.p, out.p, nullptr);
  if (cost == nullptr) {
    return nullptr;
  }
  if (g_costs.size() >= kMaxCosts) {
    for (auto& entry : g_costs) {
      Py_DECREF(entry.second);
    }
    g_costs.clear();
  }
  g_costs.emplace(std::move(key), cost);  // the table's reference
  return cost;
}

// A wrapper of `elem` as shim/tensor/wrapper.py's _new makes it (Tensor._make_wrapper_subclass with elem's
// sizes, strides, offset and dtype on mirage:0): a storage that only tracks aliasing (no data),
// the backend's key, the Python keys of a class with __torch_dispatch__.
at::Tensor wrapper_of(const at::Tensor& elem) {
  const auto sizes = elem.sizes();
  const auto strides = elem.strides();
  const auto offset = elem.storage_offset();
  const auto nbytes = at::detail::computeStorageNbytes(sizes, strides, elem.dtype().itemsize(), offset);
  c10::Storage storage(c10::Storage::use_byte_size_t{}, nbytes, c10::GetAllocator(c10::kMeta), /*resizable=*/true);
  storage.set_data_ptr_noswap(at::DataPtr(nullptr, c10::Device(c10::DeviceType::PrivateUse1, 0)));
  auto wrapper = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), elem.dtype());
  auto* impl = wrapper.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(sizes, strides, offset);
  impl->set_python_dispatch(true);
  return wrapper;
}

// The view of an exact MirageTensor, done here; false (the stack untouched) when it is not one,
// or anything is unusual: the Python path then decides, and raises what it raises.
bool view_in_cpp(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    return false;
  }
  const auto num_arguments = op.schema().arguments().size();
  auto args = stack->end() - static_cast<std::ptrdiff_t>(num_arguments);
  if (!args->isTensor()) {
    return false;
  }
  PyObject* self = args->unsafeToTensorImpl()->pyobj_slot()->load_pyobj();
  if (self == nullptr || Py_TYPE(self) != g_wrapper_type) {
    return false;
  }
  Ref elem(PyObject_GetAttr(self, g_elem));
  if (elem.p == nullptr || !THPVariable_CheckExact(elem.p)) {
    PyErr_Clear();
    return false;
  }
  const at::Tensor& cpu = THPVariable_Unpack(elem.p);
  if (cpu.is_conj() || cpu.is_neg() || cpu.layout() != c10::kStrided) {
    return false;  // _fast materializes lazy conjugate/negative views; sparse tensors have no strides
  }
  Ref gpu(PyObject_GetAttr(g_allocating, g_override));  // allocating_on(gpu) decides, as in _fast
  if (gpu.p == nullptr) {
    PyErr_Clear();
    return false;
  }
  if (gpu.p == Py_None) {
    Py_DECREF(gpu.p);
    gpu.p = PyObject_GetAttr(self, g_gpu);
  }
  Ref src(PyObject_GetAttr(self, g_src));  // the wrapper that holds the storage: views never chain
  if (gpu.p == nullptr || src.p == nullptr) {
    PyErr_Clear();
    return false;
  }
  torch::jit::Stack inner(args, stack->end());
  inner[0] = cpu;
  {
    // an error (a shape the view cannot take) reaches kernel(), which leaves the op to the
    // Python path: views have no side effects, so it runs again there and raises it
    c10::impl::ExcludeDispatchKeyGuard exclude(kAbovePython);
    op.callBoxed(inner);
  }
  at::Tensor out = std::move(inner[0]).toTensor();  // one tensor: shim/tensor/fast_dispatch.py checks the schemas
  if (out.unsafeGetTensorImpl() == cpu.unsafeGetTensorImpl()) {
    return false;  // the op handed back its input: _fast returns the same wrapper
  }
  at::Tensor wrapper = wrapper_of(out);
  Ref obj(THPVariable_Wrap(wrapper, g_wrapper_type));
  Ref out_obj(THPVariable_Wrap(std::move(out)));
  PyObject* base = src.p == Py_None ? self : src.p;
  if (obj.p == nullptr || out_obj.p == nullptr || PyObject_SetAttr(obj.p, g_elem, out_obj.p) != 0 ||
      PyObject_SetAttr(obj.p, g_gpu, gpu.p) != 0) {
    PyErr_Clear();
    return false;
  }
  if (THPVariable_Unpack(base).requires_grad()) {
    // as _new: a view of a tensor in an autograd graph takes a hold of its own (a _src link could close a
    // cycle through C++ that Python's collector never sees: see shim/tensor/wrapper.py)
    Ref mem(PyObject_CallFunctionObjArgs(g_hold, out_obj.p, gpu.p, nullptr));
    if (mem.p == nullptr || PyObject_SetAttr(obj.p, g_mem, mem.p) != 0) {
      PyErr_Clear();
      return false;
    }
  } else if (PyObject_SetAttr(obj.p, g_src, base) != 0) {
    PyErr_Clear();
    return false;
  }
  torch::jit::drop(*stack, num_arguments);
  torch::jit::push(*stack, std::move(wrapper));
  return true;
}

// Clocked mode: the cost of the plain op `op` (given -> outs), found by its signature (a new reference);
// nullptr (no Python error left set) when it cannot be had: the Python path then times the op.
PyObject* price(const c10::OperatorHandle& op, const std::vector<c10::IValue>& given,
                const std::vector<PyObject*>& wrappers, const std::vector<c10::IValue>& outs, PyObject* func) {
  Signature key;
  key.reserve(64);
  key.push_back(reinterpret_cast<int64_t>(&op.schema()));
  std::vector<const c10::TensorImpl*> seen;
  for (const auto& value : given) {
    if (!add_value(key, value, seen)) {
      return nullptr;
    }
  }
  for (const auto& value : outs) {
    if (!add_value(key, value, seen)) {
      return nullptr;
    }
  }
  PyObject* cost = cost_of(op, std::move(key), given, wrappers, outs, func);
  if (cost == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  Py_INCREF(cost);  // held: the table may start afresh while Python runs
  return cost;
}

// Advance the rank's clock by `cost`, as __torch_dispatch__ does with Clock.charge (Clock.charge_priced);
// false, with the Python exception set, if it raised.
bool advance(PyObject* cost, const std::vector<PyObject*>& wrappers, PyObject* func, long gpu_index) {
  Py_ssize_t count = 0;
  for (PyObject* w : wrappers) {
    count += w != nullptr;
  }
  Ref inputs(PyTuple_New(count));  // the emulated inputs: a collective that writes one delays the op
  Ref gpu(PyLong_FromLong(gpu_index));
  if (inputs.p == nullptr || gpu.p == nullptr) {
    return false;
  }
  Py_ssize_t next = 0;
  for (PyObject* w : wrappers) {
    if (w != nullptr) {
      Py_INCREF(w);
      PyTuple_SET_ITEM(inputs.p, next++, w);
    }
  }
  Ref done(PyObject_CallFunctionObjArgs(g_charge, gpu.p, func, cost, inputs.p, nullptr));
  return done.p != nullptr;
}

// The CPU tensor inside `t` if it is an exact, strided MirageTensor of the GPU `gpu_index` (set by the first
// met: -1 until then); false (no Python error left) for anything else.
bool unwrap_on_gpu(const at::Tensor& t, long& gpu_index, at::Tensor& elem_out) {
  if (!t.defined()) {
    return false;
  }
  PyObject* obj = t.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj();
  if (obj == nullptr || Py_TYPE(obj) != g_wrapper_type) {
    return false;
  }
  Ref elem(PyObject_GetAttr(obj, g_elem));
  Ref gpu(PyObject_GetAttr(obj, g_gpu));
  if (elem.p == nullptr || gpu.p == nullptr || !THPVariable_CheckExact(elem.p)) {
    PyErr_Clear();
    return false;
  }
  const long index = PyLong_AsLong(gpu.p);
  if (index == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  if (gpu_index != -1 && index != gpu_index) {
    return false;  // two GPUs: _dispatch raises torch's error
  }
  gpu_index = index;
  elem_out = THPVariable_Unpack(elem.p);
  return elem_out.layout() == c10::kStrided;
}

// A tensor argument as the kernels take it: an exact MirageTensor of the GPU `gpu_index` becomes its CPU tensor
// (`wrapper` set to it), a 0-dim CPU tensor (a scalar, which any op takes alongside cuda ones) stays
// (`wrapper` nullptr). False for anything else: a CPU tensor with dimensions, another GPU's (_dispatch raises
// torch's error), a subclass, a sparse one (no strides for a wrapper): the Python path decides.
bool take_tensor(c10::IValue& value, long& gpu_index, PyObject*& wrapper) {
  c10::TensorImpl* impl = value.unsafeToTensorImpl();
  PyObject* obj = impl->pyobj_slot()->load_pyobj();
  if (obj == nullptr || Py_TYPE(obj) != g_wrapper_type) {
    wrapper = nullptr;
    return !impl->key_set().has(c10::DispatchKey::Python) && impl->dim() == 0 && impl->device().is_cpu();
  }
  at::Tensor elem;
  if (!unwrap_on_gpu(value.toTensor(), gpu_index, elem)) {
    return false;
  }
  value = std::move(elem);
  wrapper = obj;
  return true;
}

// plain_in_cpp's in-place op, its arguments unwrapped into `inner`: priced (clocked mode), run, and its first
// argument's wrapper handed back. False, before anything ran, where it cannot be priced.
bool in_place_in_cpp(const c10::OperatorHandle& op, torch::jit::Stack* stack, torch::jit::Stack& inner,
                     const std::vector<c10::IValue>& given, const std::vector<PyObject*>& wrappers, PyObject* func,
                     long gpu_index) {
  const auto num_arguments = op.schema().arguments().size();
  c10::IValue self = *(stack->end() - static_cast<std::ptrdiff_t>(num_arguments));  // the wrapper written
  PyObject* cost = nullptr;
  if (g_charge != nullptr) {
    cost = price(op, given, wrappers, {self}, func);
    if (cost == nullptr) {
      return false;
    }
  }
  Ref held(cost);
  {
    NoGil no_gil;
    c10::impl::ExcludeDispatchKeyGuard exclude(kAbovePython);
    op.callBoxed(inner);  // an error (before anything is written, as torch checks first) goes to kernel()
  }
  if (cost != nullptr && !advance(cost, wrappers, func, gpu_index)) {
    PyErr_WriteUnraisable(func);  // the op ran: the clock misses it, said on stderr; it must not run again
  }
  torch::jit::drop(*stack, num_arguments);
  torch::jit::push(*stack, std::move(self));
  return true;
}

// A functional op (no aliasing, no side effects, no device arguments: shim/tensor/fast_dispatch.py picks them)
// on exact MirageTensors of one GPU and 0-dim CPU tensors, done here as _fast does it: the op on
// the CPU tensors inside (the GIL released), each output wrapped and counted by the allocator
// (ALLOCATOR.hold, in Python). False (nothing changed) when the arguments are anything else, or
// when the op or the allocator raises: the Python path then runs it again and raises what it raises.
//
// An in-place elementwise op (x.add_(y), copy_: it writes its first argument, an emulated tensor, and
// returns it) runs on that tensor's CPU tensor and hands back the same wrapper, as _fast's _same_wrapper
// does (such an op never changes its geometry; the ops are picked for that). Once it has run it is done:
// the Python path must not run it a second time, so clocked mode prices it before it runs.
bool plain_in_cpp(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    return false;
  }
  const auto num_arguments = op.schema().arguments().size();
  auto args = stack->end() - static_cast<std::ptrdiff_t>(num_arguments);
  const bool in_place = op.schema().returns().size() == 1 && op.schema().returns()[0].alias_info() != nullptr;
  if (in_place) {
    PyObject* self = args->isTensor() && args->toTensor().defined()
                         ? args->unsafeToTensorImpl()->pyobj_slot()->load_pyobj()
                         : nullptr;
    if (self == nullptr || Py_TYPE(self) != g_wrapper_type) {
      return false;  // a CPU scalar written in place, or another subclass: _dispatch decides
    }
  }
  torch::jit::Stack inner(args, stack->end());
  long gpu_index = -1;  // the GPU of the wrappers among the arguments (-1: none seen)
  const bool clocked = g_charge != nullptr;
  PyObject* func = nullptr;
  if (clocked) {
    auto found = g_funcs.find(&op.schema());
    if (found == g_funcs.end()) {
      return false;
    }
    func = found->second;
  }
  // clocked mode: the arguments as given (their costs' signature, and g_cost's arguments on a miss)
  std::vector<c10::IValue> given;
  std::vector<PyObject*> wrappers;  // borrowed: the stack holds them until this returns
  if (clocked) {
    given.assign(inner.begin(), inner.end());
    wrappers.assign(inner.size(), nullptr);
  }
  for (size_t i = 0; i < inner.size(); ++i) {
    if (!inner[i].isTensor() || !inner[i].toTensor().defined()) {
      continue;  // the ops registered take no lists of tensors
    }
    PyObject* wrapper = nullptr;
    if (!take_tensor(inner[i], gpu_index, wrapper)) {
      return false;
    }
    if (clocked) {
      wrappers[i] = wrapper;
    }
  }
  if (gpu_index == -1) {
    return false;
  }
  if (in_place) {
    return in_place_in_cpp(op, stack, inner, given, wrappers, func, gpu_index);
  }
  Ref gpu(PyObject_GetAttr(g_allocating, g_override));  // allocating_on(gpu) decides, as in _fast
  if (gpu.p == nullptr) {
    PyErr_Clear();
    return false;
  }
  if (gpu.p == Py_None) {
    Py_DECREF(gpu.p);
    gpu.p = PyLong_FromLong(gpu_index);
  }
  {
    // as the Python path's func._op does: kernels run without the GIL. An error reaches
    // kernel(), which leaves the op (functional: nothing changed) to the Python path.
    NoGil no_gil;
    c10::impl::ExcludeDispatchKeyGuard exclude(kAbovePython);
    op.callBoxed(inner);
  }
  std::vector<c10::IValue> outs;
  outs.reserve(inner.size());
  for (auto& value : inner) {
    if (!value.isTensor()) {
      outs.push_back(std::move(value));  // an undefined tensor (a backward's unneeded output)
      continue;
    }
    at::Tensor out = std::move(value).toTensor();
    if (!out.defined()) {
      outs.emplace_back(std::move(out));
      continue;
    }
    if (out.is_conj() || out.is_neg()) {
      out = out.resolve_conj().resolve_neg();  // as _wrap_one does for any op: a wrapper has no lazy bits
    }
    at::Tensor wrapper = wrapper_of(out);
    Ref obj(THPVariable_Wrap(wrapper, g_wrapper_type));
    Ref out_obj(THPVariable_Wrap(std::move(out)));
    if (obj.p == nullptr || out_obj.p == nullptr || PyObject_SetAttr(obj.p, g_elem, out_obj.p) != 0 ||
        PyObject_SetAttr(obj.p, g_gpu, gpu.p) != 0) {
      PyErr_Clear();
      return false;
    }
    Ref mem(PyObject_CallFunctionObjArgs(g_hold, out_obj.p, gpu.p, nullptr));
    if (mem.p == nullptr || PyObject_SetAttr(obj.p, g_mem, mem.p) != 0) {
      PyErr_Clear();  // the allocator refused it (out of memory): the Python path raises that
      return false;
    }
    outs.emplace_back(std::move(wrapper));
  }
  if (clocked) {
    Ref cost(price(op, given, wrappers, outs, func));
    if (cost.p == nullptr || !advance(cost.p, wrappers, func, gpu_index)) {
      PyErr_Clear();
      return false;
    }
  }
  torch::jit::drop(*stack, num_arguments);
  for (auto& value : outs) {
    torch::jit::push(*stack, std::move(value));
  }
  return true;
}

// An in-place _foreach_ op (Adam's and SGD's updates, clip_grad_norm_'s scaling: it writes the tensors of its
// first list and returns nothing) on lists of exact MirageTensors of one GPU, and 0-dim CPU tensors, done here
// as _fast does it: the op on their CPU tensors, the GIL released. Registered in functional mode only
// (clocked mode prices these in Python). False, before anything ran, for anything else.
bool foreach_in_cpp(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    return false;
  }
  const auto num_arguments = op.schema().arguments().size();
  torch::jit::Stack inner(stack->end() - static_cast<std::ptrdiff_t>(num_arguments), stack->end());
  long gpu_index = -1;
  for (auto& value : inner) {
    if (value.isTensorList()) {
      const auto list = value.toTensorList();
      c10::List<at::Tensor> elems;
      elems.reserve(list.size());
      for (const at::Tensor& t : list) {
        at::Tensor elem;
        if (!unwrap_on_gpu(t, gpu_index, elem)) {
          return false;  // an element of another kind (as _fast: the general path decides)
        }
        elems.push_back(std::move(elem));
      }
      value = std::move(elems);
    } else if (value.isTensor() && value.toTensor().defined()) {
      PyObject* wrapper = nullptr;
      if (!take_tensor(value, gpu_index, wrapper)) {
        return false;
      }
    }
  }
  if (gpu_index == -1) {
    return false;
  }
  {
    NoGil no_gil;
    c10::impl::ExcludeDispatchKeyGuard exclude(kAbovePython);
    op.callBoxed(inner);  // an error (torch checks the lists before writing) goes to kernel()
  }
  // a write of each tensor of the first list, as the GPU's foreach kernels count it (increment_version;
  // an inference tensor has no counter)
  for (const at::Tensor& t : (stack->end() - static_cast<std::ptrdiff_t>(num_arguments))->toTensorList()) {
    if (!t.is_inference()) {
      t.unsafeGetTensorImpl()->bump_version();
    }
  }
  torch::jit::drop(*stack, num_arguments);
  return true;
}

// The kernel for the Python key: `in_cpp` (view_in_cpp, plain_in_cpp, foreach_in_cpp) with the GIL held (the
// autograd engine calls ops with it released), torch's Python fallback when it declines or throws.
template <bool (*in_cpp)(const c10::OperatorHandle&, torch::jit::Stack*)>
void kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  {
    PyGILState_STATE gil = PyGILState_Ensure();
    bool done = false;
    try {
      done = in_cpp(op, stack);
    } catch (const std::exception&) {
      PyErr_Clear();  // the op's error, or anything unforeseen: the Python path decides
    }
    PyGILState_Release(gil);
    if (done) {
      return;
    }
  }
  python_fallback(op, keys, stack);
}

// _new's wrapper of a plain CPU tensor, `_elem` set: Tensor._make_wrapper_subclass's result
// without parsing its dozen keyword arguments (shim/tensor/wrapper.py: every op's output is made so).
PyObject* new_wrapper(PyObject* /*module*/, PyObject* elem) {
  if (!THPVariable_CheckExact(elem)) {
    PyErr_SetString(PyExc_TypeError, "new_wrapper takes a plain tensor");
    return nullptr;
  }
  try {
    PyObject* obj = THPVariable_Wrap(wrapper_of(THPVariable_Unpack(elem)), g_wrapper_type);
    if (obj != nullptr && PyObject_SetAttr(obj, g_elem, elem) != 0) {
      Py_CLEAR(obj);
    }
    return obj;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyMethodDef g_new_wrapper_def = {"new_wrapper", new_wrapper, METH_O, "A MirageTensor wrapping a CPU tensor."};

// ---- The signature of an op priced in Python (shim/clock/op_costs.py's signature(), here for its speed:
// ~5 us an op in Python, most of what timing the ops left to __torch_dispatch__ cost).

// Markers of the Python signature's, a marker or a type's address before each item, so that no two calls of
// different arguments give the same bytes.
enum SigTag : int64_t { kNew = 1, kSame, kList, kTuple, kKwargs, kOut };

struct PySignature {
  std::string key;                                // int64s, packed
  std::unordered_map<PyObject*, int64_t> seen;    // each tensor -> the order it first appeared in
  bool values;                                    // the op may read its other arguments' values
  void put(int64_t v) {
    key.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  void put_type(PyObject* obj) {
    put(reinterpret_cast<int64_t>(Py_TYPE(obj)));
  }
};

// Append `value` (an argument, a list or tuple of them, a result) as op_costs._add does.
// 1 for a value a signature cannot hold (an object of the program's among the values an op may read,
// an int beyond 64 bits, symbolic sizes); 0 once appended.
int sig_add(PySignature& sig, PyObject* value) {
  if (THPVariable_Check(value)) {
    auto found = sig.seen.find(value);
    if (found != sig.seen.end()) {
      sig.put(kSame);
      sig.put(found->second);
      return 0;
    }
    const int64_t order = static_cast<int64_t>(sig.seen.size());
    sig.seen.emplace(value, order);
    const at::Tensor& t = THPVariable_Unpack(value);
    if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
      return 1;
    }
    sig.put(kNew);
    sig.put_type(value);
    sig.put(static_cast<int64_t>(t.layout()));
    sig.put(static_cast<int64_t>(t.scalar_type()));
    sig.put(t.dim());
    for (auto size : t.sizes()) {
      sig.put(size);
    }
    if (t.layout() == c10::kStrided) {
      for (auto stride : t.strides()) {
        sig.put(stride);
      }
    }
    return 0;
  }
  if (PyList_Check(value) || PyTuple_Check(value)) {
    const bool is_list = PyList_Check(value);
    const Py_ssize_t n = is_list ? PyList_GET_SIZE(value) : PyTuple_GET_SIZE(value);
    sig.put(is_list ? kList : kTuple);
    sig.put(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (sig_add(sig, is_list ? PyList_GET_ITEM(value, i) : PyTuple_GET_ITEM(value, i)) != 0) {
        return 1;
      }
    }
    return 0;
  }
  sig.put_type(value);
  if (!sig.values) {
    return 0;  // an op priced by its bytes: the type alone
  }
  if (value == Py_None) {
    return 0;
  }
  if (PyBool_Check(value)) {
    sig.put(value == Py_True);
  } else if (PyLong_CheckExact(value)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow != 0) {
      return 1;
    }
    sig.put(v);
  } else if (PyFloat_CheckExact(value)) {
    const double d = PyFloat_AS_DOUBLE(value);
    int64_t bits = 0;
    std::memcpy(&bits, &d, sizeof bits);
    sig.put(bits);
  } else if (PyComplex_CheckExact(value)) {
    for (double d : {PyComplex_RealAsDouble(value), PyComplex_ImagAsDouble(value)}) {
      int64_t bits = 0;
      std::memcpy(&bits, &d, sizeof bits);
      sig.put(bits);
    }
  } else if (PyUnicode_CheckExact(value)) {
    Py_ssize_t size = 0;
    const char* text = PyUnicode_AsUTF8AndSize(value, &size);
    if (text == nullptr) {
      PyErr_Clear();
      return 1;
    }
    sig.put(size);
    sig.key.append(text, static_cast<size_t>(size));
  } else if (THPDtype_Check(value)) {
    sig.put(static_cast<int64_t>(reinterpret_cast<THPDtype*>(value)->scalar_type));
  } else if (THPDevice_Check(value)) {
    const auto& device = reinterpret_cast<THPDevice*>(value)->device;
    sig.put(static_cast<int64_t>(device.type()));
    sig.put(device.index());
  } else if (THPLayout_Check(value)) {
    sig.put(static_cast<int64_t>(reinterpret_cast<THPLayout*>(value)->layout));
  } else if (THPMemoryFormat_Check(value)) {
    sig.put(static_cast<int64_t>(reinterpret_cast<THPMemoryFormat*>(value)->memory_format));
  } else {
    return 1;
  }
  return 0;
}

// signature(values, func, args, kwargs, out) -> bytes, or None for a call a signature cannot hold: the
// call func(*args, **kwargs) -> out as op_costs.signature() keys it (the op, its tensors' type, layout,
// dtype, sizes and strides, which arguments are the same tensor, the other arguments' types, and their
// values where `values` is true).
PyObject* op_signature(PyObject* /*module*/, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 5 || !PyTuple_Check(argv[2]) || (argv[3] != Py_None && !PyDict_Check(argv[3]))) {
    PyErr_SetString(PyExc_TypeError, "signature(values, func, args: tuple, kwargs: dict | None, out)");
    return nullptr;
  }
  try {
    PySignature sig;
    sig.values = PyObject_IsTrue(argv[0]) == 1;
    sig.key.reserve(512);
    sig.put(reinterpret_cast<int64_t>(argv[1]));  // the table keeps func, so its address stays its own
    int unsigned_ = sig_add(sig, argv[2]);
    if (unsigned_ == 0 && argv[3] != Py_None && PyDict_GET_SIZE(argv[3]) > 0) {
      sig.put(kKwargs);
      sig.put(PyDict_GET_SIZE(argv[3]));
      PyObject* name = nullptr;
      PyObject* value = nullptr;
      Py_ssize_t pos = 0;
      while (unsigned_ == 0 && PyDict_Next(argv[3], &pos, &name, &value)) {
        Py_ssize_t size = 0;
        const char* text = PyUnicode_AsUTF8AndSize(name, &size);
        if (text == nullptr) {
          return nullptr;
        }
        sig.put(size);
        sig.key.append(text, static_cast<size_t>(size));
        unsigned_ = sig_add(sig, value);
      }
    }
    if (unsigned_ == 0) {
      sig.put(kOut);
      unsigned_ = sig_add(sig, argv[4]);
    }
    if (unsigned_ != 0) {
      Py_RETURN_NONE;
    }
    return PyBytes_FromStringAndSize(sig.key.data(), static_cast<Py_ssize_t>(sig.key.size()));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyMethodDef g_signature_def = {"signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(op_signature)),
                               METH_FASTCALL, "The signature of an op priced in Python (shim/clock/op_costs.py)."};

} // namespace

// new_wrapper as a Python builtin (a new reference), once mirage_register_kernels has run.
extern "C" PyObject* mirage_new_wrapper() {
  return PyCFunction_New(&g_new_wrapper_def, nullptr);
}

// op_signature as a Python builtin (a new reference).
extern "C" PyObject* mirage_op_signature() {
  return PyCFunction_New(&g_signature_def, nullptr);
}

// Register the view kernel on the ops `views` names (aten overloads: "view", "transpose.int"),
// the plain kernel on those `plain` names and the foreach one on the `foreach` names; `wrapper_type` is MirageTensor, `allocating` the
// threading.local whose .gpu overrides an output's GPU, `hold` the allocator's ALLOCATOR.hold;
// `plain_funcs` the plain ops' OpOverloads (in the order of `plain`), `cost` and `charge` clocked mode's
// pricing and clock (both None in functional mode: g_cost, g_charge). Called with the GIL held (ctypes.PyDLL). Returns 0, or -1 with a Python exception set.
extern "C" int mirage_register_kernels(PyObject* wrapper_type, PyObject* allocating, PyObject* hold,
                                       PyObject* views, PyObject* plain, PyObject* plain_funcs, PyObject* foreach,
                                       PyObject* cost, PyObject* charge) {
  if (g_library != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "the kernels are registered already");
    return -1;
  }
  if (!PyType_Check(wrapper_type) || !PyList_Check(views) || !PyList_Check(plain) || !PyList_Check(plain_funcs) ||
      !PyList_Check(foreach) ||
      PyList_GET_SIZE(plain_funcs) != PyList_GET_SIZE(plain) || (cost == Py_None) != (charge == Py_None)) {
    PyErr_SetString(PyExc_TypeError,
                    "expected the wrapper's type, two lists of op names, the plain ops, a list of op names and two callables or Nones");
    return -1;
  }
  g_elem = PyUnicode_InternFromString("_elem");
  g_gpu = PyUnicode_InternFromString("_gpu");
  g_src = PyUnicode_InternFromString("_src");
  g_mem = PyUnicode_InternFromString("_mem");
  g_override = PyUnicode_InternFromString("gpu");
  Py_INCREF(wrapper_type);
  Py_INCREF(allocating);
  Py_INCREF(hold);
  g_wrapper_type = reinterpret_cast<PyTypeObject*>(wrapper_type);
  g_allocating = allocating;
  g_hold = hold;
  try {
    // a failure part way deletes the library, which takes back the kernels it registered
    auto library = std::make_unique<torch::Library>(
        torch::Library::IMPL, "aten", c10::DispatchKey::Python, "shim/native/fast_dispatch.cpp", __LINE__);
    for (PyObject* names : {views, plain, foreach}) {
      for (Py_ssize_t i = 0; i < PyList_GET_SIZE(names); ++i) {
        const char* name = PyUnicode_AsUTF8(PyList_GET_ITEM(names, i));
        if (name == nullptr) {
          return -1;
        }
        library->impl(name, names == views     ? torch::CppFunction::makeFromBoxedFunction<&kernel<&view_in_cpp>>()
                            : names == foreach ? torch::CppFunction::makeFromBoxedFunction<&kernel<&foreach_in_cpp>>()
                                               : torch::CppFunction::makeFromBoxedFunction<&kernel<&plain_in_cpp>>());
        if (names == plain) {
          std::string full(name);
          const auto dot = full.find('.');
          const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(
              ("aten::" + full.substr(0, dot)).c_str(), dot == std::string::npos ? "" : full.substr(dot + 1).c_str());
          PyObject* func = PyList_GET_ITEM(plain_funcs, i);
          Py_INCREF(func);
          g_funcs[&handle.schema()] = func;
        }
      }
    }
    if (cost != Py_None) {
      Py_INCREF(cost);
      Py_INCREF(charge);
      g_cost = cost;
      g_charge = charge;
    }
    g_library = library.release();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return -1;
  }
  return 0;
}
