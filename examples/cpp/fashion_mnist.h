#pragma once
// Fashion-MNIST reader: the four gzip-compressed IDX files, read directly with zlib.
//
//   fashion_mnist::Split train = fashion_mnist::load(dir, /*train=*/true, /*limit=*/512);
//
// Header-only (every examples/cpp/*.cpp is its own program). Images stay uint8 [N, 28, 28] so
// the dataset costs 47 MB, not 188 MB; batches are converted to float on the fly. The data
// comes from the Debian package `dataset-fashion-mnist`; a missing file is an error that says
// how to install it (there is no synthetic fallback).

#include <torch/types.h>
#include <zlib.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace fashion_mnist {

inline constexpr const char* kDefaultDir = "/usr/share/datasets/fashion-mnist";
inline constexpr double kMean = 0.2860;  // of the training images scaled to [0, 1]
inline constexpr double kStd = 0.3530;

struct Split {
  torch::Tensor images;  // uint8 [N, 28, 28]
  torch::Tensor labels;  // int64 [N]
};

inline std::string missing_data_message(const std::string& path) {
  return "Fashion-MNIST data not found: " + path +
         "\n  It comes from the Debian package `dataset-fashion-mnist`; install it with\n"
         "    sudo apt-get install dataset-fashion-mnist\n"
         "  (files land in " +
         std::string(kDefaultDir) + "), or pass --data DIR with the four *-ubyte.gz files.";
}

// Reads a whole .gz file (also plain files: gzread passes them through).
inline std::vector<std::uint8_t> read_gz(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) throw std::runtime_error(missing_data_message(path));
  std::vector<std::uint8_t> bytes;
  std::uint8_t chunk[1 << 16];
  int n = 0;
  while ((n = gzread(file, chunk, sizeof(chunk))) > 0) bytes.insert(bytes.end(), chunk, chunk + n);
  int err = 0;
  const char* msg = gzerror(file, &err);
  const std::string error = (n < 0 || (err != Z_OK && err != Z_STREAM_END)) ? msg : "";
  gzclose(file);
  if (!error.empty()) throw std::runtime_error("cannot decompress " + path + ": " + error);
  return bytes;
}

inline std::uint32_t read_be32(const std::vector<std::uint8_t>& b, std::size_t at) {
  return (std::uint32_t{b[at]} << 24) | (std::uint32_t{b[at + 1]} << 16) |
         (std::uint32_t{b[at + 2]} << 8) | std::uint32_t{b[at + 3]};
}

// Parses an IDX file of unsigned bytes: magic 0x0000 08 <ndim>, then ndim big-endian sizes.
// Returns a uint8 tensor of the first `limit` items (all when limit <= 0).
inline torch::Tensor read_idx_u8(const std::string& path, std::int64_t limit) {
  const std::vector<std::uint8_t> b = read_gz(path);
  if (b.size() < 4 || b[0] != 0 || b[1] != 0 || b[2] != 0x08 || b[3] == 0)
    throw std::runtime_error(path + ": not an IDX file of unsigned bytes");
  const std::size_t ndim = b[3];
  if (b.size() < 4 + 4 * ndim) throw std::runtime_error(path + ": truncated IDX header");
  std::vector<std::int64_t> sizes(ndim);
  std::int64_t item = 1;
  for (std::size_t d = 0; d < ndim; ++d) {
    sizes[d] = read_be32(b, 4 + 4 * d);
    if (d > 0) item *= sizes[d];
  }
  const std::size_t header = 4 + 4 * ndim;
  if (b.size() != header + static_cast<std::size_t>(sizes[0] * item))
    throw std::runtime_error(path + ": size does not match its IDX header");
  if (limit > 0 && limit < sizes[0]) sizes[0] = limit;
  torch::Tensor out = torch::empty(sizes, torch::kUInt8);
  std::memcpy(out.data_ptr(), b.data() + header, static_cast<std::size_t>(sizes[0] * item));
  return out;
}

// The training ("train") or test ("t10k") split, first `limit` items (all when limit <= 0).
inline Split load(const std::string& dir, bool train, std::int64_t limit = 0) {
  const std::string prefix = dir + "/" + (train ? "train" : "t10k");
  Split split;
  split.images = read_idx_u8(prefix + "-images-idx3-ubyte.gz", limit);
  split.labels = read_idx_u8(prefix + "-labels-idx1-ubyte.gz", limit).to(torch::kLong);
  if (split.images.dim() != 3 || split.images.size(1) != 28 || split.images.size(2) != 28 ||
      split.images.size(0) != split.labels.size(0))
    throw std::runtime_error(prefix + ": images and labels do not match (expected N x 28 x 28)");
  return split;
}

// uint8 [B, 28, 28] -> normalized float [B, 1, 28, 28] on `device`.
inline torch::Tensor to_input(const torch::Tensor& images_u8, const torch::Device& device) {
  return images_u8.to(device).unsqueeze(1).to(torch::kFloat).div_(255.0).sub_(kMean).div_(kStd);
}

}  // namespace fashion_mnist
