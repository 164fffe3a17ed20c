#pragma once
// A small byte-level GPT trained on the Python standard library's own sources: the second A/B
// workload (docs/char_gpt.md). Header-only: the file lists and data loading, the model, its
// presets, batch sampling and the held-out windows. The trainer is train_char_gpt.cpp; the Python
// twin, examples/python/train_char_gpt.py, holds the same lists, model and sampling, so both draw
// the same batches and start from the same weights for the same seed.
#include <torch/nn.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace char_gpt {

// Training text: these stdlib modules, concatenated in this order (about 1.7 MB). Every one exists,
// as a plain module file with its real source, in CPython 3.9 to 3.13 (none was removed or turned
// into a package or a stub: not datetime.py, pathlib.py, zipfile.py, sysconfig.py, ...).
// Keep this list identical to TRAIN_FILES in examples/python/train_char_gpt.py (tested).
inline const std::vector<std::string>& train_files() {
  static const std::vector<std::string> files = {
      "argparse.py",   "ast.py",
      "calendar.py",   "configparser.py",
      "csv.py",        "dataclasses.py",
      "difflib.py",    "doctest.py",
      "enum.py",       "fractions.py",
      "functools.py",  "heapq.py",
      "inspect.py",    "logging/__init__.py",
      "mailbox.py",    "pickle.py",
      "pprint.py",     "pydoc.py",
      "random.py",     "shutil.py",
      "statistics.py", "subprocess.py",
      "tarfile.py",    "tempfile.py",
      "threading.py",  "typing.py",
  };
  return files;
}

// Held-out text for val_bpc (about 175 KB): modules that are not in the training list.
// Keep identical to VAL_FILES in the Python twin (tested).
inline const std::vector<std::string>& val_files() {
  static const std::vector<std::string> files = {
      "textwrap.py", "shlex.py", "copy.py",  "queue.py",    "getopt.py",  "numbers.py",
      "fnmatch.py",  "glob.py",  "sched.py", "optparse.py", "gettext.py",
  };
  return files;
}

inline bool is_file(const std::string& path) { return std::ifstream(path).good(); }

// The default --data: the newest /usr/lib/python3.N that holds every file of both lists (a
// directory with only dist-packages left in it is passed over). Empty when there is none.
inline std::string default_data_dir() {
  for (int minor = 40; minor >= 6; --minor) {
    const std::string dir = "/usr/lib/python3." + std::to_string(minor);
    bool all = true;
    for (const auto* list : {&train_files(), &val_files()})
      for (const auto& f : *list) all = all && is_file(dir + "/" + f);
    if (all) return dir;
  }
  return "";
}

// The files of `names` under `dir`, concatenated, as a 1-D uint8 tensor (bytes, no decoding).
// A missing file is an error naming the file and the directory.
inline torch::Tensor load_text(const std::string& dir, const std::vector<std::string>& names) {
  std::string text;
  for (const auto& name : names) {
    const std::string path = dir + "/" + name;
    std::ifstream in(path, std::ios::binary);
    if (!in)
      throw std::runtime_error("stdlib file " + name + " not found in " + dir +
                               " (--data DIR: a CPython 3.9-3.13 standard library directory)");
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  auto out = torch::empty({static_cast<std::int64_t>(text.size())}, torch::kUInt8);
  std::memcpy(out.data_ptr<std::uint8_t>(), text.data(), text.size());
  return out;
}

constexpr std::int64_t kVocab = 256;  // bytes

// Model and batch sizes of a preset (--preset; single flags override them).
struct Config {
  std::int64_t d_model, n_layer, n_head, seq_len, batch_size;
  double lr;
};

// tiny: the CPU preset; gpu: compute-bound on an H100; test: a few milliseconds a step, for tests.
inline bool preset_config(const std::string& name, Config* out) {
  if (name == "tiny")
    *out = {128, 4, 4, 128, 16, 2e-3};
  else if (name == "gpu")
    *out = {512, 8, 8, 256, 32, 6e-4};
  else if (name == "test")
    *out = {32, 2, 2, 32, 4, 2e-3};
  else
    return false;
  return true;
}

// Optimizer steps of a run (--steps overrides).
inline std::int64_t preset_steps(const std::string& name) {
  return name == "gpu" ? 2000 : name == "test" ? 20 : 300;
}

// Held-out bytes scored per evaluation (--eval-bytes overrides; 0: all of the held-out text).
inline std::int64_t preset_eval_bytes(const std::string& name) {
  return name == "gpu" ? 0 : name == "test" ? 2048 : 32768;
}

// aten::linear, as Python's nn.Linear calls it. LibTorch's Linear module does matmul and then
// `+= bias` for inputs of more than 2 dimensions: the same values in fp32, but under O1/O2 the
// in-place bias add rounds the fp16 matmul output once more, and the twins would drift apart.
inline torch::Tensor linear(const torch::nn::Linear& layer, const torch::Tensor& x) {
  return torch::linear(x, layer->weight, layer->bias);
}

// Causal self-attention: one qkv projection, scaled_dot_product_attention(is_causal), projection.
struct AttentionImpl : torch::nn::Module {
  AttentionImpl(std::int64_t d_model, std::int64_t n_head)
      : n_head(n_head),
        c_attn(register_module("c_attn", torch::nn::Linear(d_model, 3 * d_model))),
        c_proj(register_module("c_proj", torch::nn::Linear(d_model, d_model))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const std::int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / n_head;
    const auto qkv = linear(c_attn, x).split(C, 2);
    const auto q = qkv[0].view({B, T, n_head, hd}).transpose(1, 2);
    const auto k = qkv[1].view({B, T, n_head, hd}).transpose(1, 2);
    const auto v = qkv[2].view({B, T, n_head, hd}).transpose(1, 2);
    const auto y = torch::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{},
                                                       /*dropout_p=*/0.0, /*is_causal=*/true);
    return linear(c_proj, y.transpose(1, 2).contiguous().view({B, T, C}));
  }
  std::int64_t n_head;
  torch::nn::Linear c_attn, c_proj;
};
TORCH_MODULE(Attention);

// Pre-LN block: x + attn(ln1(x)), then x + mlp(ln2(x)) with a 4x GELU MLP.
struct BlockImpl : torch::nn::Module {
  BlockImpl(std::int64_t d_model, std::int64_t n_head)
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})))),
        attn(register_module("attn", Attention(d_model, n_head))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})))),
        c_fc(register_module("c_fc", torch::nn::Linear(d_model, 4 * d_model))),
        c_proj(register_module("c_proj", torch::nn::Linear(4 * d_model, d_model))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = x + attn(ln1(x));
    return x + linear(c_proj, torch::gelu(linear(c_fc, ln2(x))));
  }
  torch::nn::LayerNorm ln1;
  Attention attn;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear c_fc, c_proj;
};
TORCH_MODULE(Block);

// GPT-2 style: token + learned position embeddings, n_layer pre-LN blocks, final LayerNorm, an
// (untied) linear head over the 256 byte values. Parameters are registered in the same order as
// the Python twin's, and init_weights() draws them in that order from the default generator.
struct GPTImpl : torch::nn::Module {
  GPTImpl(const Config& c)  // NOLINT(google-explicit-constructor)
      : tok_emb(register_module("tok_emb", torch::nn::Embedding(kVocab, c.d_model))),
        pos_emb(register_module("pos_emb", torch::nn::Embedding(c.seq_len, c.d_model))),
        blocks(register_module("blocks", torch::nn::ModuleList())) {
    for (std::int64_t i = 0; i < c.n_layer; ++i) blocks->push_back(Block(c.d_model, c.n_head));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    head = register_module("head", torch::nn::Linear(c.d_model, kVocab));
    init_weights(c.n_layer);
  }
  // GPT-2's init: matrices and embeddings N(0, 0.02), the residual projections (c_proj)
  // N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorms 1/0.
  void init_weights(std::int64_t n_layer) {
    torch::NoGradGuard no_grad;
    const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(n_layer));
    for (auto& p : named_parameters()) {
      const std::string& name = p.key();
      auto& t = p.value();
      const bool is_bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
      if (t.dim() >= 2)
        t.normal_(0.0, name.find("c_proj.weight") != std::string::npos ? proj_std : 0.02);
      else if (is_bias)
        t.zero_();
    }
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    const auto pos = torch::arange(idx.size(1), idx.options().dtype(torch::kLong));
    auto x = tok_emb(idx) + pos_emb(pos);
    for (const auto& block : *blocks) x = block->as<Block>()->forward(x);
    return linear(head, ln_f(x));
  }
  torch::nn::Embedding tok_emb, pos_emb;
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(GPT);

// A training batch: `batch` random windows of seq_len + 1 bytes (starts drawn by torch::randint
// with `gen`, as torch.randint(0, n - seq_len, (batch,), generator=gen) in Python); x = the first
// seq_len bytes of each window, y = the last seq_len (the next byte at every position).
inline std::pair<torch::Tensor, torch::Tensor> get_batch(const torch::Tensor& data,
                                                         std::int64_t batch, std::int64_t seq_len,
                                                         at::Generator& gen,
                                                         const torch::Device& device) {
  const auto starts = torch::randint(0, data.size(0) - seq_len, {batch}, gen, torch::kLong);
  const auto idx = starts.unsqueeze(1) + torch::arange(seq_len + 1, torch::kLong);
  const auto w = data.index_select(0, idx.flatten()).view({batch, seq_len + 1}).to(torch::kLong);
  return {w.slice(1, 0, seq_len).contiguous().to(device),
          w.slice(1, 1, seq_len + 1).contiguous().to(device)};
}

// Starts of the held-out windows: evenly spaced over the whole held-out text, as many as fit in
// eval_bytes (0: the whole text, windows about seq_len apart), at least one. Integer arithmetic,
// the same in the Python twin.
inline std::vector<std::int64_t> eval_starts(std::int64_t n, std::int64_t seq_len,
                                             std::int64_t eval_bytes) {
  const std::int64_t last = n - seq_len - 1;  // the last start whose window of seq_len + 1 fits
  if (last < 0) throw std::runtime_error("held-out text shorter than one window (--seq-len)");
  std::int64_t count = (n - 1) / seq_len;
  if (eval_bytes > 0) count = std::min(count, std::max<std::int64_t>(1, eval_bytes / seq_len));
  std::vector<std::int64_t> starts;
  for (std::int64_t i = 0; i < count; ++i) starts.push_back(count > 1 ? i * last / (count - 1) : 0);
  return starts;
}

}  // namespace char_gpt
