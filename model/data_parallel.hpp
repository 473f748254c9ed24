// Data parallel training's gradient reduction (DESIGN.md §16) on a Communicator. Micro-batch m of
// rank r is the step's global micro-batch r + m * N; a step's gradient is the sum, in global
// micro-batch order, of each micro-batch's gradient computed from zero:
// - train.grad_reduce = ordered: after each local micro-batch every rank's gradient is all-gathered
//   and added in rank order, so N ranks give the bits of one rank with all N * grad_accum
//   micro-batches, for any grad_accum (float32 on the wire; bf16 rounds what is sent);
// - allreduce: each rank adds its own micro-batches in order (Gpt::backward with accumulate),
//   then the engine's all-reduce sums the ranks (its order: bounded, not bitwise).
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
  // (ordered: the gathered buffer is size() * chunk elements).
  GradientReducer(Communicator& comm, Backend& be, int64_t n, GradReduce mode, GradComm wire,
                  int64_t chunk = int64_t{1} << 22);
  GradReduce mode() const { return mode_; }
  // ordered: grads holds this rank's micro-batch m's gradient (from zero); every rank's m-th is
  // added, in rank order, to the step's sum.
  void add_micro_batch(const TensorView& grads, int64_t m);
  // End of the step: grads = the step's gradient on every rank (allreduce: grads held this
  // rank's ordered sum of its micro-batches).
  void finish(const TensorView& grads);
  // Bytes of the reducer's buffers in the backend's memory.
  size_t bytes() const;

 private:
  Communicator& comm_;
  Backend& be_;
  int64_t n_, chunk_;
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
