// Reads tests/op_cases.txt and runs its cases through the dispatcher (see op_cases.h and the
// file's header for the notation).
#include "op_cases.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>

#include <cctype>
#include <fstream>
#include <memory>
#include <sstream>

namespace amp::testing {
namespace {

// One parsed argument: a tensor to build, a list, a literal or a reference to an earlier one.
struct Arg {
  enum Kind { kTensor, kIndex, kList, kInt, kFloat, kBool, kNone, kStr, kDtype, kRef } kind;
  std::string tensor_kind;    // n, r, u, c, hi, signs, logp, z, spd; "cpu_i" / "i" / "i32" (kIndex)
  std::vector<int64_t> ints;  // the shape (kTensor) or the values (kIndex)
  std::vector<int64_t> view;  // kIndex: the shape to view the values as (may be empty)
  std::vector<Arg> items;     // kList
  int64_t integer = 0;        // kInt, kRef (the argument index)
  double real = 0;            // kFloat
  bool flag = false;          // kBool
  std::string text;           // kStr
  std::string keyword;        // set for "name=value"
};

class Parser {
 public:
  explicit Parser(std::string text) : s_(std::move(text)) {}

  std::vector<Arg> arguments() {
    std::vector<Arg> out;
    while (skip_space(), pos_ < s_.size()) {
      std::string keyword;
      const size_t eq = s_.find('=', pos_);
      const size_t word_end = word_end_at(pos_);
      if (eq != std::string::npos && eq == word_end) {
        keyword = s_.substr(pos_, eq - pos_);
        pos_ = eq + 1;
      }
      Arg a = value();
      a.keyword = keyword;
      out.push_back(std::move(a));
    }
    return out;
  }

 private:
  void skip_space() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  size_t word_end_at(size_t p) const {
    while (p < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[p])) || s_[p] == '_')) ++p;
    return p;
  }
  [[noreturn]] void fail(const std::string& what) const {
    TORCH_CHECK(false, "tests/op_cases.txt: ", what, " at '", s_.substr(pos_), "' in '", s_, "'");
  }
  void expect(char c) {
    if (pos_ >= s_.size() || s_[pos_] != c) fail(std::string("expected '") + c + "'");
    ++pos_;
  }
  std::vector<int64_t> ints_until(char close) {
    std::vector<int64_t> out;
    while (pos_ < s_.size() && s_[pos_] != close) {
      size_t used = 0;
      out.push_back(std::stoll(s_.substr(pos_), &used));
      pos_ += used;
      if (pos_ < s_.size() && s_[pos_] == ',') ++pos_;
    }
    expect(close);
    return out;
  }

  Arg value() {
    skip_space();
    Arg a{};
    if (pos_ >= s_.size()) fail("expected a value");
    const char c = s_[pos_];
    if (c == '[') {
      ++pos_;
      a.kind = Arg::kList;
      while (skip_space(), pos_ < s_.size() && s_[pos_] != ']') {
        a.items.push_back(value());
        skip_space();
        if (pos_ < s_.size() && s_[pos_] == ',') ++pos_;
      }
      expect(']');
      return a;
    }
    if (c == '"') {
      const size_t end = s_.find('"', pos_ + 1);
      if (end == std::string::npos) fail("unterminated string");
      a.kind = Arg::kStr;
      a.text = s_.substr(pos_ + 1, end - pos_ - 1);
      pos_ = end + 1;
      return a;
    }
    if (c == '$') {
      ++pos_;
      a.kind = Arg::kRef;
      size_t used = 0;
      a.integer = std::stoll(s_.substr(pos_), &used);
      pos_ += used;
      return a;
    }
    if (c == '-' || std::isdigit(static_cast<unsigned char>(c))) {
      size_t end = pos_ + 1;
      while (end < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[end])) ||
                                 s_[end] == '.' || s_[end] == '-')) {
        ++end;
      }
      const std::string number = s_.substr(pos_, end - pos_);
      pos_ = end;
      if (number.find_first_of(".e") != std::string::npos) {
        a.kind = Arg::kFloat;
        a.real = std::stod(number);
      } else {
        a.kind = Arg::kInt;
        a.integer = std::stoll(number);
      }
      return a;
    }
    const size_t end = word_end_at(pos_);
    const std::string word = s_.substr(pos_, end - pos_);
    pos_ = end;
    if (word == "none" || word == "float32") {
      a.kind = word == "none" ? Arg::kNone : Arg::kDtype;
      return a;
    }
    if (word == "true" || word == "false") {
      a.kind = Arg::kBool;
      a.flag = word == "true";
      return a;
    }
    if (word == "i" || word == "cpu_i" || word == "i32") {
      a.kind = Arg::kIndex;
      a.tensor_kind = word;
      expect('[');
      a.ints = ints_until(']');
      if (pos_ < s_.size() && s_[pos_] == '(') {
        ++pos_;
        a.view = ints_until(')');
      }
      return a;
    }
    if (word == "n" || word == "r" || word == "u" || word == "c" || word == "hi" ||
        word == "signs" || word == "logp" || word == "z" || word == "spd") {
      a.kind = Arg::kTensor;
      a.tensor_kind = word;
      expect('(');
      a.ints = ints_until(')');
      return a;
    }
    fail("unknown value '" + word + "'");
  }

  std::string s_;
  size_t pos_ = 0;
};

at::Tensor make_tensor(const Arg& a, at::ScalarType t, at::Device device) {
  const auto in = at::dtype(t).device(device);
  const auto fp32 = at::dtype(at::kFloat).device(device);
  const auto& k = a.tensor_kind;
  if (k == "n") return at::randn(a.ints, in);
  if (k == "r") return at::rand(a.ints, in) + 0.5;
  if (k == "u") return at::rand(a.ints, in);
  if (k == "c") return at::rand(a.ints, in) - 0.5;
  if (k == "hi") return at::rand(a.ints, fp32) + 0.5;
  if (k == "logp") return at::log_softmax(at::randn(a.ints, fp32), -1).to(t);
  if (k == "z") return at::randn(a.ints, fp32.dtype(at::kComplexFloat));  // complex64 always
  if (k == "spd") {  // symmetric positive definite, made in fp32, handed over in dtype t
    const auto m = at::randn({a.ints[0], a.ints[0]}, fp32);
    return (m.mm(m.t()) + at::eye(a.ints[0], fp32) * a.ints[0]).to(t);
  }
  TORCH_CHECK(k == "signs" && a.ints.size() == 1, "tests/op_cases.txt: bad tensor ", k);
  return (at::arange(a.ints[0], fp32).remainder(2) * -2 + 1).to(t);  // +1, -1, +1, ...
}

at::Tensor make_index(const Arg& a, at::Device device) {
  at::Tensor t = at::tensor(a.ints, at::kLong);
  if (a.tensor_kind == "i32") t = t.to(at::kInt);  // LU / LDL pivots
  if (a.tensor_kind != "cpu_i") t = t.to(device);
  return a.view.empty() ? t : t.view(a.view);
}

// The argument as the IValue the schema's `type` takes (lists of tensors and of optional
// tensors differ; a number for a float argument is a double).
c10::IValue to_ivalue(const Arg& a, const c10::TypePtr& declared, at::ScalarType t,
                      at::Device device, const std::vector<c10::IValue>& built) {
  c10::TypePtr type = declared;
  if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
  switch (a.kind) {
    case Arg::kTensor:
      return make_tensor(a, t, device);
    case Arg::kIndex:
      return make_index(a, device);
    case Arg::kInt:
      if (type->kind() == c10::TypeKind::FloatType) return static_cast<double>(a.integer);
      return a.integer;
    case Arg::kFloat:
      return a.real;
    case Arg::kBool:
      return a.flag;
    case Arg::kNone:
      return c10::IValue();
    case Arg::kStr:
      return a.text;
    case Arg::kDtype:
      return at::kFloat;
    case Arg::kRef:
      TORCH_CHECK(a.integer < static_cast<int64_t>(built.size()), "tests/op_cases.txt: $",
                  a.integer, " refers to a later argument");
      return built[a.integer];
    case Arg::kList:
      break;
  }
  const auto list = type->cast<c10::ListType>();
  TORCH_CHECK(list, "tests/op_cases.txt: a list given for an argument of type ", *declared);
  const c10::TypePtr element = list->getElementType();
  if (element->cast<c10::OptionalType>()) {  // Tensor?[]
    c10::List<std::optional<at::Tensor>> out;
    for (const Arg& item : a.items) {
      out.push_back(to_ivalue(item, element, t, device, built).toOptional<at::Tensor>());
    }
    return out;
  }
  if (element->kind() == c10::TypeKind::TensorType) {
    c10::List<at::Tensor> out;
    for (const Arg& item : a.items)
      out.push_back(to_ivalue(item, element, t, device, built).toTensor());
    return out;
  }
  std::vector<int64_t> ints;
  for (const Arg& item : a.items) {
    TORCH_CHECK(item.kind == Arg::kInt, "tests/op_cases.txt: expected a list of ints for ",
                *declared);
    ints.push_back(item.integer);
  }
  return ints;
}

std::vector<OpCase> load_all() {
  std::ifstream file(OPTAMP_OP_CASE_FILE);
  TORCH_CHECK(file, "cannot open ", OPTAMP_OP_CASE_FILE);
  std::vector<OpCase> out;
  std::string line;
  while (std::getline(file, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream row(line);
    OpCase c;
    std::string result;
    row >> c.policy >> c.name >> result;
    std::getline(row, c.arguments);
    TORCH_CHECK(result == "-" || result == "bool" || result == "complex64" || result == "int64",
                "tests/op_cases.txt: result ", result, " of ", c.name,
                " must be -, bool, complex64 or int64");
    if (result == "bool") c.result = at::kBool;
    if (result == "complex64") c.result = at::kComplexFloat;
    if (result == "int64") c.result = at::kLong;
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace

std::vector<OpCase> op_cases(const std::string& policy) {
  static const std::vector<OpCase> all = load_all();
  std::vector<OpCase> out;
  for (const auto& c : all) {
    if (c.policy == policy) out.push_back(c);
  }
  return out;
}

at::Tensor run_case(const OpCase& c, at::ScalarType t, at::Device device) {
  const size_t dot = c.name.find('.');
  const std::string name = "aten::" + c.name.substr(0, dot);
  const std::string overload = dot == std::string::npos ? "" : c.name.substr(dot + 1);
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
  const auto& schema = op.schema().arguments();
  std::vector<std::optional<c10::IValue>> slots(schema.size());
  std::vector<c10::IValue> built;  // the positional arguments so far (for $k)
  size_t position = 0;
  for (const Arg& a : Parser(c.arguments).arguments()) {
    size_t k = position;
    if (!a.keyword.empty()) {
      for (k = 0; k < schema.size() && schema[k].name() != a.keyword; ++k) {
      }
    } else {
      ++position;
    }
    TORCH_CHECK(k < schema.size(), "tests/op_cases.txt: ", c.name, " has no argument ",
                a.keyword.empty() ? std::to_string(k) : a.keyword);
    slots[k] = to_ivalue(a, schema[k].type(), t, device, built);
    if (a.keyword.empty()) built.push_back(*slots[k]);
  }
  torch::jit::Stack stack;
  for (size_t k = 0; k < schema.size(); ++k) {
    if (!slots[k]) {
      TORCH_CHECK(schema[k].default_value().has_value(), "tests/op_cases.txt: ", c.name,
                  " needs its argument ", schema[k].name());
      slots[k] = *schema[k].default_value();
    }
    stack.push_back(std::move(*slots[k]));
  }
  op.callBoxed(&stack);
  const c10::IValue& first = stack.at(0);
  return first.isTensorList() ? first.toTensorList().get(0) : first.toTensor();  // meshgrid
}

}  // namespace amp::testing
