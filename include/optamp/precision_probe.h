#pragma once
// A per-op precision report (docs/precision.md): while a PrecisionProbe records, every ATen op
// call, forward and backward, is observed through an at::RecordFunction callback, and per op
// (and module scope, and phase) it keeps the dtypes the calls ran in, the largest |value|, how
// many output values would overflow or flush to zero in float16 / bfloat16, how many were not
// finite, and which op produced the first inf/NaN.
//
//   amp::PrecisionProbe probe;                       // records from here
//   {
//     amp::PrecisionProbe::Scope scope("encoder.layers.0.mlp");  // names the ops inside
//     loss = model(x) ...;
//   }
//   loss.backward();                                 // backward ops carry the forward's scope
//   probe.stop();
//   std::cout << probe.table();
//
// Cost: nothing while no probe records (the callback is removed with the last probe). While one
// records, each op's floating outputs are measured with a few ATen reductions and one
// device->host read: on a GPU the probe synchronizes after every op. It is a diagnostic for a
// few steps, not for a whole run. The measurement never changes what the program computes: it
// runs under no_grad, outside optamp's casting keys and autocast, with itself switched off.
//
// One probe records at a time (process-wide); a second one is a c10::Error naming the first.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "optamp/export.h"

namespace amp {

class OPTAMP_API PrecisionProbe {
 public:
  enum class Phase { kForward, kBackward };

  struct DtypeCount {
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    std::int64_t calls = 0;  // calls whose floating outputs (inputs if none) had this dtype
  };

  // One op in one scope and phase (and, in backward, one autograd node).
  struct Row {
    std::string op;     // "aten::addmm"
    std::string scope;  // the module path active in forward ("" outside any Scope)
    Phase phase = Phase::kForward;
    std::string node;  // backward: the autograd node that ran it ("AddmmBackward0"), else ""
    std::int64_t calls = 0;
    std::int64_t first_call = 0;  // index of its first call among all the probe saw (from 0)
    std::vector<DtypeCount> dtypes;
    std::int64_t elements = 0;   // floating output elements, over all calls
    std::int64_t nonfinite = 0;  // of them inf or NaN
    double max_abs = 0.0;        // the largest finite |value|
    // Finite values whose cast to float16 / bfloat16 gives inf (overflow), and nonzero values
    // whose cast gives 0 (flush); values already in that dtype are neither. A cast op's column
    // for its output dtype counts what it converted: the values it actually lost.
    std::int64_t fp16_overflow = 0;
    std::int64_t fp16_flush = 0;
    std::int64_t bf16_overflow = 0;
    std::int64_t bf16_flush = 0;
    std::int64_t finite() const { return elements - nonfinite; }
    // count / elements, 0 when nothing was measured.
    double fraction(std::int64_t count) const;
  };

  // The first op call that made an inf or NaN (the innermost: its end comes first): its outputs
  // held a NaN where none of its inputs (tensors and scalar arguments) did, or an inf where none
  // did. Infinities a program puts in on purpose and carries on (an attention mask's -inf,
  // filled from a scalar, cast, added to the scores) are not made by the ops that carry them.
  // Where no op made one, it is the first call that carried one from a tensor no recorded op
  // made, with `from_inputs` set (values from outside the recorded ops: a corrupt batch, a mask
  // buffer built before the probe started); infinities from scalar arguments are not named.
  struct NonFinite {
    std::string op;
    Phase phase = Phase::kForward;
    std::string scope;
    std::string node;          // backward: the autograd node
    std::int64_t call = 0;     // index among all calls the probe saw
    std::int64_t op_call = 0;  // which call of this op/scope/phase row (from 1)
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    std::int64_t count = 0;  // inf/NaN values in its outputs
    std::int64_t elements = 0;
    bool from_inputs = false;  // no op made one: this call's inputs held them already
  };

  struct Report {
    std::vector<Row> rows;  // sorted by first call
    std::optional<NonFinite> first_nonfinite;
    std::int64_t calls = 0;       // op calls seen
    std::int64_t unmeasured = 0;  // calls whose outputs could not be read (counted, not measured)
  };

  // RAII: names the ops this thread runs inside it (a module path, as given: push the full
  // path). Nestable; the innermost names the ops. Costs a string push when no probe records.
  class OPTAMP_API Scope {
   public:
    explicit Scope(std::string name);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    std::size_t depth_;
  };

  // Starts recording. `label` names this probe in the error a second probe gets.
  explicit PrecisionProbe(std::string label = {});
  ~PrecisionProbe();  // stop()
  PrecisionProbe(const PrecisionProbe&) = delete;
  PrecisionProbe& operator=(const PrecisionProbe&) = delete;

  // Ends recording (idempotent); the report stays readable.
  void stop();
  bool recording() const;

  Report report() const;
  std::optional<NonFinite> first_nonfinite() const;
  // Markdown: op, scope, phase, dtypes, calls, max|x|, fp16 overflow %, fp16 flush %, bf16
  // overflow %, bf16 flush %, non-finite; the first inf/NaN under it. max_rows >= 1: the rows
  // with the most overflow/flush/non-finite first, then by first call; the rest summarized.
  std::string table(int max_rows = 40) const;
  // The whole report as JSON ({"calls", "rows": [...], "first_nonfinite": {...}|null}).
  std::string json() const;

  static const char* phase_name(Phase phase);  // "forward", "backward"

  struct State;  // internal

 private:
  std::shared_ptr<State> state_;
};

}  // namespace amp
