// Data parallel training's gradient reduction (DESIGN.md §16) on a Communicator. Micro-batch m of
// rank r is the step's global micro-batch r + m * N; a step's gradient is the sum, in global
// micro-batch order, of each micro-batch's gradient computed from zero:
// - train.grad_reduce = ordered: after each local micro-batch every rank's gradient is all-gathered
//   and added in rank order, so N ranks give the bits of one rank with all N * grad_accum
//   micro-batches, for any grad_accum (float32 on the wire; bf16 rounds what is sent);
// - allreduce: each rank adds its own micro-batches in order (Gpt::backward with accumulate),
//   then the engine's all-reduce sums the ranks (its order: bounded, not bitwise), bucket by
//   bucket while the last micro-batch's backward pass goes on (as PyTorch DDP does).
#pragma once

#include <cstdint>
#include <vector>

#include "emu/backend.hpp"
#include "model/checkpoint.hpp"
#include "model/communicator.hpp"
#include "model/config.hpp"

namespace fp4sim::model {

class GradientReducer {
 public:
  // n: gradient elements (float32, the backend's memory). chunk: elements all-gathered at a time
  // (ordered: the gathered buffer is size() * chunk elements). bucket: allreduce's elements a
  // bucket (at least: a bucket is whole blocks' gradients).
  GradientReducer(Communicator& comm, Backend& be, int64_t n, GradReduce mode, GradComm wire,
                  int64_t chunk = int64_t{1} << 22, int64_t bucket = int64_t{25} << 18);
  GradReduce mode() const { return mode_; }
  // ordered: grads holds this rank's micro-batch m's gradient (from zero); every rank's m-th is
  // added, in rank order, to the step's sum.
  void add_micro_batch(const TensorView& grads, int64_t m);
  // allreduce, the step's last micro-batch (Gpt::set_grads_ready): grads[offset, n) are final;
  // a bucket's worth (or, at offset 0, the rest) is all-reduced from here, asynchronously.
  void ready(const TensorView& grads, int64_t offset);
  // End of the step: grads = the step's gradient on every rank (allreduce: grads held this
  // rank's ordered sum of its micro-batches; what ready did not start starts here).
  void finish(const TensorView& grads);
  int64_t buckets_started() const { return buckets_; }  // (in the last step)
  // Bytes of the reducer's buffers in the backend's memory.
  size_t bytes() const;

 private:
  Communicator& comm_;
  Backend& be_;
  void start(const TensorView& grads, int64_t begin, int64_t end);
  int64_t n_, chunk_, bucket_;
  int64_t started_from_;  // allreduce: grads[started_from_, n) are being reduced
  int64_t buckets_ = 0, buckets_now_ = 0;
  GradReduce mode_;
  GradComm wire_;
  BackendBuffer sum_, gathered_, wire_buf_, widened_;
};

// ZeRO-1 (train.zero=1): the rank that holds each tensor's optimizer state. Whole tensors (Muon
// and ROOT orthogonalise whole matrices, Q-AdamW keeps an amax a tensor), greedily balanced: the
// largest first, each to the rank with the fewest elements so far (ties: the lower rank; tensors
// of one size in index order), so every rank computes the same assignment.
std::vector<int> shard_tensors(const std::vector<int64_t>& numels, int world);

// Every rank's tensors, merged (their names must differ between ranks), on every rank: the
// sharded optimizer state gathered for rank 0's checkpoint. Host memory: each rank receives every
// rank's bytes.
TensorMap gather_tensor_maps(Communicator& comm, const TensorMap& mine);

}  // namespace fp4sim::model
