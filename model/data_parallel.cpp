#include "model/data_parallel.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>

#include "model/memory_plan.hpp"

namespace fp4sim::model {

GradientReducer::GradientReducer(Communicator& comm, Backend& be, int64_t n, GradReduce mode,
                                 GradComm wire, int64_t chunk, int64_t bucket)
    : comm_(comm),
      be_(be),
      n_(n),
      chunk_(std::min(chunk, n)),
      bucket_(std::max<int64_t>(bucket, 1)),
      started_from_(n),
      mode_(mode),
      wire_(wire) {
  const size_t N = static_cast<size_t>(comm.size());
  const size_t w = wire == GradComm::BF16 ? 2 : 4;
  if (mode == GradReduce::Ordered) {
    sum_ =
        BackendBuffer(be, static_cast<size_t>(n) * 4, {kUseGradients, "the ranks' gradient sum"});
    gathered_ = BackendBuffer(be, N * static_cast<size_t>(chunk_) * w,
                              {kUseGradients, "the ranks' gathered gradients"});
    if (wire == GradComm::BF16) {
      wire_buf_ = BackendBuffer(be, static_cast<size_t>(chunk_) * 2,
                                {kUseGradients, "gradients sent (BF16)"});
      widened_ = BackendBuffer(be, static_cast<size_t>(chunk_) * 4,
                               {kUseGradients, "a rank's gradients received (BF16 widened)"});
    }
  } else if (wire == GradComm::BF16) {
    wire_buf_ = BackendBuffer(be, static_cast<size_t>(n) * 2,
                              {kUseGradients, "gradients all-reduced (BF16)"});
  }
}

size_t GradientReducer::bytes() const {
  return sum_.bytes() + gathered_.bytes() + wire_buf_.bytes() + widened_.bytes();
}

void GradientReducer::add_micro_batch(const TensorView& grads, int64_t m) {
  if (mode_ != GradReduce::Ordered) throw std::logic_error("add_micro_batch: not ordered");
  const Device d = be_.device();
  const int N = comm_.size();
  const bool bf16 = wire_ == GradComm::BF16;
  for (int64_t o = 0; o < n_; o += chunk_) {
    const int64_t len = std::min(chunk_, n_ - o);
    const TensorView mine = view_of(grads.as<float>() + o, DType::F32, 1, len, d, "gradients");
    const TensorView sum =
        view_of(static_cast<float*>(sum_.get()) + o, DType::F32, 1, len, d, "gradient sum");
    TensorView sent = mine;
    if (bf16) {
      sent = view_of(wire_buf_.get(), DType::BF16, 1, len, d, "gradients sent (BF16)");
      be_.convert(sent, mine);
    }
    const TensorView all = view_of(gathered_.get(), sent.dtype, 1, len * N, d, "gathered");
    comm_.all_gather(sent, all);
    for (int r = 0; r < N; ++r) {
      const size_t at = static_cast<size_t>(r) * static_cast<size_t>(len) * (bf16 ? 2 : 4);
      TensorView g =
          view_of(static_cast<char*>(gathered_.get()) + at, sent.dtype, 1, len, d, "rank gradient");
      if (bf16) {
        const TensorView wide =
            view_of(widened_.get(), DType::F32, 1, len, d, "rank gradient (widened)");
        be_.convert(wide, g);
        g = wide;
      }
      if (m == 0 && r == 0)
        be_.copy(sum.data, g.data, static_cast<size_t>(len) * 4);
      else
        be_.axpby(sum, 1.0f, sum, 1.0f, g);
    }
  }
}

void GradientReducer::start(const TensorView& grads, int64_t begin, int64_t end) {
  const Device d = be_.device();
  const int64_t len = end - begin;
  const TensorView g = view_of(grads.as<float>() + begin, DType::F32, 1, len, d, "gradients");
  if (wire_ == GradComm::BF16) {
    const TensorView w = view_of(static_cast<uint16_t*>(wire_buf_.get()) + begin, DType::BF16, 1,
                                 len, d, "gradients (BF16)");
    be_.convert(w, g);
    comm_.all_reduce_sum_async(w);
  } else {
    comm_.all_reduce_sum_async(g);
  }
  ++buckets_now_;
}

void GradientReducer::ready(const TensorView& grads, int64_t offset) {
  if (mode_ != GradReduce::AllReduce) return;
  if (started_from_ - offset >= bucket_ || (offset == 0 && started_from_ > 0)) {
    start(grads, offset, started_from_);
    started_from_ = offset;
  }
}

void GradientReducer::finish(const TensorView& grads) {
  if (mode_ == GradReduce::Ordered) {
    be_.copy(grads.data, sum_.get(), static_cast<size_t>(n_) * 4);
    return;
  }
  if (started_from_ > 0) start(grads, 0, started_from_);  // (no ready calls, or not down to 0)
  comm_.wait();
  if (wire_ == GradComm::BF16)
    be_.convert(grads, view_of(wire_buf_.get(), DType::BF16, 1, n_, be_.device(), "gradients"));
  started_from_ = n_;
  buckets_ = buckets_now_;
  buckets_now_ = 0;
}

std::vector<int> shard_tensors(const std::vector<int64_t>& numels, int world) {
  std::vector<size_t> order(numels.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  std::vector<int64_t> load(static_cast<size_t>(world), 0);
  std::vector<int> owner(numels.size(), 0);
  for (size_t i : order) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = r;
    load[static_cast<size_t>(r)] += numels[i];
  }
  return owner;
}

namespace {

// A TensorMap as bytes and back: per tensor its name, dtype, shape and bytes, each length first.
void put(std::string& out, const void* p, size_t n) { out.append(static_cast<const char*>(p), n); }
void put_u64(std::string& out, uint64_t v) { put(out, &v, 8); }
void put_str(std::string& out, const std::string& s) {
  put_u64(out, s.size());
  out += s;
}

std::string pack(const TensorMap& m) {
  std::string out;
  put_u64(out, m.size());
  for (const auto& [name, t] : m) {
    put_str(out, name);
    put_str(out, t.dtype);
    put_u64(out, t.shape.size());
    for (int64_t d : t.shape) put_u64(out, static_cast<uint64_t>(d));
    put_u64(out, t.bytes.size());
    put(out, t.bytes.data(), t.bytes.size());
  }
  return out;
}

void unpack(const std::string& in, TensorMap* m, int rank) {
  size_t at = 0;
  auto take = [&](void* dst, size_t n) {
    if (at + n > in.size())
      throw std::runtime_error("gather_tensor_maps: rank " + std::to_string(rank) +
                               "'s tensors are cut short");
    std::memcpy(dst, in.data() + at, n);
    at += n;
  };
  auto u64 = [&] {
    uint64_t v;
    take(&v, 8);
    return v;
  };
  auto str = [&] {
    std::string s(u64(), '\0');
    take(s.data(), s.size());
    return s;
  };
  for (uint64_t k = u64(); k > 0; --k) {
    const std::string name = str();
    StoredTensor t;
    t.dtype = str();
    t.shape.resize(u64());
    for (int64_t& d : t.shape) d = static_cast<int64_t>(u64());
    t.bytes.resize(u64());
    take(t.bytes.data(), t.bytes.size());
    if (!m->emplace(name, std::move(t)).second)
      throw std::logic_error("gather_tensor_maps: tensor '" + name + "' on two ranks");
  }
}

}  // namespace

TensorMap gather_tensor_maps(Communicator& comm, const TensorMap& mine) {
  const std::vector<std::string> all = all_gather_strings(comm, pack(mine));
  TensorMap out;
  for (int r = 0; r < comm.size(); ++r) unpack(all[static_cast<size_t>(r)], &out, r);
  return out;
}

}  // namespace fp4sim::model
