#include "model/communicator.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace fp4sim::model {

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& s) {
  const int n = comm.size();
  const uint64_t len = s.size();
  std::vector<uint64_t> lens(static_cast<size_t>(n));
  comm.all_gather_host(&len, lens.data(), sizeof len);
  const uint64_t width = std::max<uint64_t>(1, *std::max_element(lens.begin(), lens.end()));
  // in pieces of at most 64 MiB a rank (MPI's int counts; the NCCL communicator's staging buffer)
  const uint64_t piece = std::min<uint64_t>(width, uint64_t{64} << 20);
  std::vector<std::string> out(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) out[static_cast<size_t>(r)].resize(lens[static_cast<size_t>(r)]);
  std::vector<char> mine(piece), all(piece * static_cast<size_t>(n));
  for (uint64_t at = 0; at < width; at += piece) {
    const uint64_t len = std::min(piece, width - at);
    std::fill(mine.begin(), mine.end(), '\0');
    if (at < s.size())
      std::memcpy(mine.data(), s.data() + at, std::min<uint64_t>(len, s.size() - at));
    comm.all_gather_host(mine.data(), all.data(), len);
    for (int r = 0; r < n; ++r) {
      std::string& o = out[static_cast<size_t>(r)];
      if (at < o.size())
        std::memcpy(o.data() + at, all.data() + len * static_cast<size_t>(r),
                    std::min<uint64_t>(len, o.size() - at));
    }
  }
  return out;
}

void throw_first_failure(Communicator& comm, const std::string& my_error) {
  const std::vector<std::string> errors = all_gather_strings(comm, my_error);
  for (int r = 0; r < comm.size(); ++r) {
    const std::string& e = errors[static_cast<size_t>(r)];
    if (!e.empty()) throw CollectiveError(r == 0 ? e : "rank " + std::to_string(r) + ": " + e);
  }
}

void check_ranks_agree(Communicator& comm,
                       const std::vector<std::pair<std::string, std::string>>& values) {
  const auto shown = [](const std::string& kv) {  // the value of "key=value", shortened
    const std::string v = kv.substr(kv.find('=') + 1);
    return v.size() > 64 ? v.substr(0, 64) + "..." : v;
  };
  std::string mismatches;
  for (const auto& [key, value] : values) {
    const std::vector<std::string> all = all_gather_strings(comm, key + "=" + value);
    std::string ranks;
    int first = 0;
    for (int r = 1; r < comm.size(); ++r)
      if (all[static_cast<size_t>(r)] != all[0]) {
        ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
        if (!first) first = r;
      }
    if (!ranks.empty())
      mismatches += (mismatches.empty() ? "" : "; ") + key + " of rank" +
                    (ranks.find(',') == std::string::npos ? " " : "s ") + ranks +
                    " differs from rank 0's (rank 0: " + shown(all[0]) + ", rank " +
                    std::to_string(first) + ": " + shown(all[static_cast<size_t>(first)]) + ")";
  }
  if (!mismatches.empty())
    throw CollectiveError("the " + std::to_string(comm.size()) +
                          " ranks do not agree: " + mismatches);
}

}  // namespace fp4sim::model
