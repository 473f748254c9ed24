// A GPU timeline recorder for machines without Nsight Systems: a CUDA injection library
// (CUDA_INJECTION64_PATH=libfp4sim_cupti_trace.so) that records, through CUPTI's activity API,
// every kernel, memcpy and memset with its GPU start and end time, and every CUDA runtime call with
// its host start and end time, and writes them as CSV when the process exits:
//   kind,name,start_ns,end_ns,bytes
// kind: kernel | memcpy_htod | memcpy_dtoh | memcpy_dtod | memcpy_other | memset | runtime.
// The output path is FP4SIM_TRACE_OUT (default fp4sim_trace.csv). validation/trace_gaps.py reads
// it: per-step GPU busy time against the step's span, and the idle gaps with the calls around them.
#include <cupti.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Event {
  const char* kind;
  std::string name;
  uint64_t start, end, bytes;
};

std::mutex g_mutex;
std::vector<Event>* g_events = nullptr;  // (leaked on purpose: read in the atexit handler)
std::atomic<bool> g_failed{false};

void report(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "fp4sim cupti_trace: %s failed: %s\n", what, msg ? msg : "unknown error");
  g_failed = true;
}

constexpr size_t kBufferBytes = 8u << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

const char* memcpy_kind(uint8_t k) {
  switch (k) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "memcpy_htod";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "memcpy_dtoh";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "memcpy_dtod";
    default:
      return "memcpy_other";
  }
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<Event> got;
  CUpti_Activity* rec = nullptr;
  for (;;) {
    const CUptiResult r = cuptiActivityGetNextRecord(buffer, valid, &rec);
    if (r == CUPTI_ERROR_MAX_LIMIT_REACHED) break;
    if (r != CUPTI_SUCCESS) {
      report(r, "cuptiActivityGetNextRecord");
      break;
    }
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        got.push_back({"kernel", k->name ? k->name : "?", k->start, k->end, 0});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        got.push_back({memcpy_kind(m->copyKind), "", m->start, m->end, m->bytes});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        got.push_back({"memset", "", m->start, m->end, m->bytes});
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME: {
        const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
        const char* name = nullptr;
        cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &name);
        got.push_back({"runtime", name ? name : "?", a->start, a->end, 0});
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_events->insert(g_events->end(), got.begin(), got.end());
}

void write_trace() {
  report(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  const char* path = std::getenv("FP4SIM_TRACE_OUT");
  if (!path || !*path) path = "fp4sim_trace.csv";
  std::lock_guard<std::mutex> lock(g_mutex);
  std::FILE* f = std::fopen(path, "w");
  if (!f) {
    std::fprintf(stderr, "fp4sim cupti_trace: cannot write %s (%s)\n", path, std::strerror(errno));
    return;
  }
  std::fprintf(f, "kind,name,start_ns,end_ns,bytes\n");
  for (const Event& e : *g_events) {
    std::string name = e.name;  // (quoted: kernel names hold commas)
    for (char& c : name)
      if (c == '"') c = '\'';
    std::fprintf(f, "%s,\"%s\",%llu,%llu,%llu\n", e.kind, name.c_str(),
                 static_cast<unsigned long long>(e.start), static_cast<unsigned long long>(e.end),
                 static_cast<unsigned long long>(e.bytes));
  }
  // (an exit handler cannot change the process's exit status: a failed write is said loudly)
  const bool write_failed = std::fflush(f) != 0 || std::ferror(f);
  const int err = errno;
  if (std::fclose(f) != 0 || write_failed) {
    std::fprintf(stderr,
                 "fp4sim cupti_trace: ERROR: writing %s failed (%s); the trace is incomplete\n",
                 path, std::strerror(write_failed ? err : errno));
    return;
  }
  std::fprintf(stderr, "fp4sim cupti_trace: %zu records -> %s%s\n", g_events->size(), path,
               g_failed ? " (with CUPTI errors above: the trace may be incomplete)" : "");
}

}  // namespace

// called by the CUDA driver when CUDA_INJECTION64_PATH names this library
extern "C" int InitializeInjection(void) {
  g_events = new std::vector<Event>();
  g_events->reserve(1u << 20);
  report(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
         "cuptiActivityRegisterCallbacks");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memset");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "enable runtime API");
  std::atexit(write_trace);
  return 1;
}
