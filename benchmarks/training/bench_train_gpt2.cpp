// Training-step throughput and peak memory of a GPT-2-small-sized transformer (12 layers,
// d_model 768, 12 heads, vocab 50257, seq 512, batch 8, AdamW) at O0 (TF32 off/on), O1..O5 and
// native AMP. See train_harness.h.
//
//   bench_train_gpt2 [--device cuda] [--batch 8] [--seq 512] [--layers 12] [--rounds 3]
//   bench_train_gpt2 --device cpu --small               # seconds-long CPU smoke test

#include "bench_models.h"
#include "train_harness.h"

namespace {

class GPT2Workload : public bench::Workload {
 public:
  std::string name() const override { return "bench_train_gpt2"; }
  std::string describe() const override {
    return "GPT layers " + std::to_string(opts_.layers) + " d_model " +
           std::to_string(opts_.d_model) + " heads " + std::to_string(opts_.heads) + " vocab " +
           std::to_string(opts_.vocab) + ", batch " + std::to_string(batch_) + " x seq " +
           std::to_string(opts_.seq) + (fused_ ? ", amp::FusedAdamW" : ", AdamW");
  }
  bool parse_flag(const std::string& f, const std::string& v) override {
    if (f == "--batch")
      batch_ = std::stoll(v);
    else if (f == "--seq")
      opts_.seq = std::stoll(v);
    else if (f == "--layers")
      opts_.layers = std::stoll(v);
    else if (f == "--d-model")
      opts_.d_model = std::stoll(v);
    else if (f == "--heads")
      opts_.heads = std::stoll(v);
    else if (f == "--vocab")
      opts_.vocab = std::stoll(v);
    else
      return false;
    return true;
  }
  void small() override {
    batch_ = 2;
    opts_ = {512, 64, 2, 128, 4};
  }
  std::string usage() const override {
    return "  model: [--batch 8] [--seq 512] [--layers 12] [--d-model 768] [--heads 12] "
           "[--vocab 50257]\n"
           "  --small = --batch 2 --seq 64 --layers 2 --d-model 128 --heads 4 --vocab 512\n";
  }
  std::int64_t samples_per_step() const override { return batch_; }
  void build(const torch::Device& device) override {
    model_ = bench::GPT(opts_);
    model_->to(device);
    model_->train();
    const auto options = torch::optim::AdamWOptions(1e-4).weight_decay(0.01);
    if (fused_) {
      optimizer_ = std::make_unique<amp::FusedAdamW>(model_->parameters(), options);
    } else {
      optimizer_ = std::make_unique<torch::optim::AdamW>(model_->parameters(), options);
    }
    const auto opt = torch::dtype(torch::kLong).device(device);
    tokens_ = torch::randint(opts_.vocab, {batch_, opts_.seq}, opt);
    targets_ = torch::randint(opts_.vocab, {batch_, opts_.seq}, opt);
  }
  std::shared_ptr<torch::nn::Module> module() override { return model_.ptr(); }
  torch::optim::Optimizer& optimizer() override { return *optimizer_; }
  torch::Tensor loss() override {
    const auto logits = model_->forward(tokens_);
    return torch::nn::functional::cross_entropy(logits.view({-1, opts_.vocab}),
                                                targets_.view({-1}));
  }
  void destroy() override {
    optimizer_.reset();
    model_ = bench::GPT(nullptr);
    tokens_ = targets_ = torch::Tensor();
  }

 private:
  bench::GPTOptions opts_;
  std::int64_t batch_ = 8;
  bench::GPT model_{nullptr};
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  torch::Tensor tokens_, targets_;
};

}  // namespace

int main(int argc, char** argv) {
  GPT2Workload wl;
  return bench::harness_main(wl, argc, argv);
}
