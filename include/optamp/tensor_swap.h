#pragma once
// Keeping optamp's records of a tensor when another tensor's TensorImpl takes its place.
//
// torch.utils.swap_tensors (Python) exchanges two tensors' TensorImpls while each Python object
// keeps its identity. Module.to()/.half()/load_state_dict() use it for every parameter under
// torch.__future__.set_swap_module_params_on_conversion(True) (announced as a future default), and
// always for tensor-subclass parameters (DTensor). It refuses while anything holds a weak
// reference to either TensorImpl, and optamp keeps its per-tensor records by weak references (so
// that a reused address is never mistaken for a dead tensor). The Python front therefore takes
// the records off both tensors before the swap and puts them back after it, on the TensorImpl
// each tensor holds then: the records follow the tensor the model and the optimizer hold.

#include <ATen/core/Tensor.h>

#include <memory>

#include "optamp/export.h"

namespace amp {

// The records taken off two tensors (opaque).
class SwapHold;

// Takes off every record optamp keeps by a weak reference to `a`'s or `b`'s TensorImpl: the
// parameter's dtype and name as initialize recorded them, O2/O5's working-copy registration (and
// its dispatch key), loss scaling's marks between guards (scaled gradients under delay_unscale,
// an overflow not yet stepped past). Cached casts of either are dropped: made again from the
// data the tensor holds afterwards. Not thread-safe against a forward using `a` or `b` meanwhile,
// as the swap itself is not.
OPTAMP_API std::shared_ptr<SwapHold> hold_records_for_swap(const at::Tensor& a,
                                                           const at::Tensor& b);

// Puts the records taken by hold_records_for_swap back, on the TensorImpls `a` and `b` hold now
// (exchanged or not, so this is also the way back when the swap failed). Once per hold.
OPTAMP_API void restore_records_after_swap(SwapHold& hold, const at::Tensor& a,
                                           const at::Tensor& b);

// While one lives on this thread, the records restore_records_after_swap puts back are published
// together when the outermost one ends (one new session, not one per swap: Module.to() and
// load_state_dict() swap the parameters one by one). Inside it, swapped tensors are not yet
// registered: only conversions and loads belong there.
class OPTAMP_API SwapBatch {
 public:
  SwapBatch();
  ~SwapBatch();
  SwapBatch(const SwapBatch&) = delete;
  SwapBatch& operator=(const SwapBatch&) = delete;
};

}  // namespace amp
