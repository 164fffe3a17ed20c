#pragma once
// The models of the training-throughput benchmarks (benchmarks/training/*.cpp), in plain
// LibTorch. benchmarks/bench_models.py defines the same two models for the Python side.
//
//   ResNet-50: torchvision's resnet50 layout (bottleneck blocks 3-4-6-3, width 64, stride on the
//              3x3 conv, batch-norm everywhere, 1000 classes). Smaller variants through
//              ResNetOptions (fewer blocks, narrower, fewer classes) for CPU smoke runs.
//   GPT-2:     a GPT-2-small-sized decoder (12 layers, d_model 768, 12 heads, vocab 50257, learned
//              position embeddings, pre-layer-norm blocks, causal scaled_dot_product_attention,
//              tanh-GELU MLP 4x, final layer norm, LM head tied to the token embedding).

#include <torch/nn.h>

#include <cstdint>
#include <string>
#include <vector>

namespace bench {

// ---- ResNet-50 ------------------------------------------------------------------------------
struct ResNetOptions {
  std::vector<std::int64_t> blocks{3, 4, 6, 3};
  std::int64_t width = 64;  // channels of the stem and of the first stage's bottleneck
  std::int64_t classes = 1000;
};

inline torch::nn::Conv2d conv(std::int64_t in, std::int64_t out, std::int64_t k,
                              std::int64_t stride = 1) {
  return torch::nn::Conv2d(
      torch::nn::Conv2dOptions(in, out, k).stride(stride).padding(k / 2).bias(false));
}

struct BottleneckImpl : torch::nn::Module {
  static constexpr std::int64_t kExpansion = 4;
  BottleneckImpl(std::int64_t inplanes, std::int64_t planes, std::int64_t stride)
      : conv1(conv(inplanes, planes, 1)),
        bn1(planes),
        conv2(conv(planes, planes, 3, stride)),
        bn2(planes),
        conv3(conv(planes, planes * kExpansion, 1)),
        bn3(planes * kExpansion) {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    register_module("conv2", conv2);
    register_module("bn2", bn2);
    register_module("conv3", conv3);
    register_module("bn3", bn3);
    if (stride != 1 || inplanes != planes * kExpansion) {
      downsample = register_module(
          "downsample", torch::nn::Sequential(conv(inplanes, planes * kExpansion, 1, stride),
                                              torch::nn::BatchNorm2d(planes * kExpansion)));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = torch::relu(bn1(conv1(x)));
    out = torch::relu(bn2(conv2(out)));
    out = bn3(conv3(out));
    return torch::relu(out + (downsample ? downsample->forward(x) : x));
  }
  torch::nn::Conv2d conv1, conv2, conv3;
  torch::nn::BatchNorm2d bn1, bn2, bn3;
  torch::nn::Sequential downsample{nullptr};
};
TORCH_MODULE(Bottleneck);

struct ResNetImpl : torch::nn::Module {
  explicit ResNetImpl(const ResNetOptions& o = {})
      : conv1(torch::nn::Conv2dOptions(3, o.width, 7).stride(2).padding(3).bias(false)),
        bn1(o.width) {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    std::int64_t inplanes = o.width;
    for (std::size_t stage = 0; stage < o.blocks.size(); ++stage) {
      torch::nn::Sequential layer;
      const std::int64_t planes = o.width << stage;
      for (std::int64_t b = 0; b < o.blocks[stage]; ++b) {
        layer->push_back(Bottleneck(inplanes, planes, b == 0 && stage > 0 ? 2 : 1));
        inplanes = planes * BottleneckImpl::kExpansion;
      }
      layers.push_back(register_module("layer" + std::to_string(stage + 1), layer));
    }
    fc = register_module("fc", torch::nn::Linear(inplanes, o.classes));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(bn1(conv1(x))), 3, 2, 1);
    for (auto& layer : layers) x = layer->forward(x);
    return fc(torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1));
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  std::vector<torch::nn::Sequential> layers;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNet);

// ---- GPT-2 ----------------------------------------------------------------------------------
struct GPTOptions {
  std::int64_t vocab = 50257;
  std::int64_t seq = 512;  // context length (= size of the position table)
  std::int64_t layers = 12;
  std::int64_t d_model = 768;
  std::int64_t heads = 12;
};

struct GPTBlockImpl : torch::nn::Module {
  GPTBlockImpl(std::int64_t d, std::int64_t heads)
      : heads(heads),
        ln1(torch::nn::LayerNormOptions({d})),
        qkv(d, 3 * d),
        proj(d, d),
        ln2(torch::nn::LayerNormOptions({d})),
        fc(d, 4 * d),
        fc_proj(4 * d, d) {
    register_module("ln1", ln1);
    register_module("qkv", qkv);
    register_module("proj", proj);
    register_module("ln2", ln2);
    register_module("fc", fc);
    register_module("fc_proj", fc_proj);
  }
  torch::Tensor forward(torch::Tensor x) {
    const auto B = x.size(0), T = x.size(1), C = x.size(2);
    auto qkv_ = qkv(ln1(x)).view({B, T, 3, heads, C / heads}).permute({2, 0, 3, 1, 4});
    auto y = at::scaled_dot_product_attention(qkv_[0], qkv_[1], qkv_[2], /*attn_mask=*/{},
                                              /*dropout_p=*/0.0, /*is_causal=*/true);
    x = x + proj(y.transpose(1, 2).reshape({B, T, C}));
    namespace F = torch::nn::functional;
    return x + fc_proj(F::gelu(fc(ln2(x)), F::GELUFuncOptions().approximate("tanh")));
  }
  std::int64_t heads;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc, fc_proj;
};
TORCH_MODULE(GPTBlock);

struct GPTImpl : torch::nn::Module {
  explicit GPTImpl(const GPTOptions& o = {})
      : wte(o.vocab, o.d_model),
        wpe(o.seq, o.d_model),
        ln_f(torch::nn::LayerNormOptions({o.d_model})) {
    register_module("wte", wte);
    register_module("wpe", wpe);
    for (std::int64_t i = 0; i < o.layers; ++i)
      blocks.push_back(register_module("h" + std::to_string(i), GPTBlock(o.d_model, o.heads)));
    register_module("ln_f", ln_f);
    torch::NoGradGuard no_grad;  // GPT-2's init: N(0, 0.02) weights
    for (auto& p : parameters())
      if (p.dim() >= 2) p.normal_(0.0, 0.02);
  }
  // tokens: [B, T] int64 -> logits [B, T, vocab]
  torch::Tensor forward(const torch::Tensor& tokens) {
    const auto T = tokens.size(1);
    auto x = wte(tokens) + wpe(torch::arange(T, tokens.options()));
    for (auto& block : blocks) x = block(x);
    return torch::matmul(ln_f(x), wte->weight.t());  // tied LM head
  }
  torch::nn::Embedding wte, wpe;
  std::vector<GPTBlock> blocks;
  torch::nn::LayerNorm ln_f;
};
TORCH_MODULE(GPT);

}  // namespace bench
