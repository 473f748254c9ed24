#include "emu/backend.hpp"

#include <cstdio>
#include <new>
#include <stdexcept>
#include <utility>
#include <vector>

#include "emu/cpu_backend.hpp"
#include "emu/formats.hpp"

namespace fp4sim {

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<emu::CpuBackend>(); }

std::string bytes_text(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char head[32];
  if (u == 0)
    std::snprintf(head, sizeof head, "%llu B", static_cast<unsigned long long>(bytes));
  else
    std::snprintf(head, sizeof head, "%.2f %s", v, kUnits[u]);
  return std::string(head) + " (" + std::to_string(bytes) + " bytes)";
}

void* Backend::allocate_labelled(size_t bytes, const BufferLabel& label) {
  // (the label is the planning backend's; a nested allocation keeps the outer one's afterwards)
  const BufferLabel* const outer = allocating_;
  allocating_ = &label;
  try {
    void* p = allocate(bytes);
    allocating_ = outer;
    return p;
  } catch (const AllocationError&) {
    allocating_ = outer;
    throw;
  } catch (const std::bad_alloc&) {
    allocating_ = outer;
    throw AllocationError(allocation_failure(label, bytes, "out of host memory (std::bad_alloc)"),
                          bytes);
  } catch (const std::exception& e) {
    allocating_ = outer;
    throw AllocationError(allocation_failure(label, bytes, e.what()), bytes);
  }
}

std::string Backend::allocation_failure(const BufferLabel& label, size_t bytes,
                                        const std::string& cause) const {
  const std::string what = label.what.empty() ? std::string("a buffer") : "'" + label.what + "'";
  return "cannot allocate " + bytes_text(bytes) + " for " + what + " (" + label.use + ") in the " +
         name_ + " backend's " + (device_ == Device::Host ? "host" : "device") +
         " memory: " + cause;
}

void check_view(const char* op, const TensorView& v, int64_t rows, int64_t cols,
                const ViewRule& rule) {
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument(std::string(op) + ": tensor '" + v.name + "' " + what);
  };
  if (!v.present()) {
    if (rule.optional) return;
    fail("is missing");
  }
  if (v.rows != rows || v.cols != cols)
    fail("is " + shape_str(v.rows, v.cols) + ", expected " + shape_str(rows, cols));
  const bool dtype_ok = (v.dtype == DType::F32 && rule.f32) ||
                        (v.dtype == DType::BF16 && rule.bf16) ||
                        (v.dtype == DType::I32 && rule.i32) || (v.dtype == DType::U8 && rule.u8);
  if (!dtype_ok) {
    std::string want;
    for (auto [ok, n] : {std::pair<bool, const char*>{rule.f32, "float32"},
                         {rule.bf16, "bfloat16"},
                         {rule.i32, "int32"},
                         {rule.u8, "uint8"}})
      if (ok) want += std::string(want.empty() ? "" : " or ") + n;
    fail(std::string("is ") + dtype_name(v.dtype) + ", expected " + want);
  }
  if (rule.strided ? v.stride() < v.cols : !v.dense())
    fail(rule.strided ? "has row stride " + std::to_string(v.stride()) + " < its " +
                            std::to_string(v.cols) + " columns"
                      : "must be dense (row stride " + std::to_string(v.stride()) + ")");
  if (v.bf16_values && (!rule.bf16_values || v.dtype != DType::F32))
    fail("is marked as holding BF16 values where the op reads or writes it as stored");
}

void validate_segments(const char* op, const std::vector<Segment>& segments) {
  for (size_t i = 0; i < segments.size(); ++i)
    if (segments[i].offset < 0 || segments[i].count < 0)
      throw std::invalid_argument(std::string(op) + ": tensor " + std::to_string(i) +
                                  " has offset " + std::to_string(segments[i].offset) +
                                  " and count " + std::to_string(segments[i].count));
}

QuantizedBuffers::QuantizedBuffers(Backend& b, const QuantizedHost& h)
    : codes(b, h.codes.size()), scales(b, h.scales.size()), amax(b, sizeof(float)) {
  view.codes = codes.as<uint8_t>();
  view.scales = scales.as<uint8_t>();
  view.amax = amax.as<float>();
  view.rows = h.rows;
  view.cols = h.cols;
  view.format = h.format;
  view.four_over_six = h.four_over_six;
  view.device = b.device();
}

QuantizedBuffers QuantizedBuffers::uploaded(Backend& b, const QuantizedHost& h) {
  QuantizedBuffers q(b, h);
  q.upload_from(b, h);
  return q;
}

void QuantizedBuffers::upload_from(Backend& b, const QuantizedHost& h) {
  b.upload(codes.get(), h.codes.data(), h.codes.size());
  b.upload(scales.get(), h.scales.data(), h.scales.size());
  b.upload(amax.get(), &h.amax, sizeof(float));
}

void QuantizedBuffers::download_to(Backend& b, QuantizedHost& h) {
  b.download(h.codes.data(), codes.get(), h.codes.size());
  b.download(h.scales.data(), scales.get(), h.scales.size());
  b.download(&h.amax, amax.get(), sizeof(float));
}

QuantizeResult quantize_to_host(Backend& backend, const TensorView& host_x,
                                const QuantizeConfig& cfg) {
  validate_quantize(host_x, cfg);
  QuantizeResult res;
  const CopyShape rs = written_shape(host_x, false), cs = written_shape(host_x, true);
  if (cfg.rowwise.enabled)
    res.rowwise.resize(rs.rows, rs.cols, cfg.format, cfg.rowwise.four_over_six);
  if (cfg.columnwise.enabled)
    res.columnwise.resize(cs.rows, cs.cols, cfg.format, cfg.columnwise.four_over_six);
  const size_t in_bytes =
      static_cast<size_t>(host_x.rows * host_x.stride()) * dtype_size(host_x.dtype);
  BackendBuffer in(backend, in_bytes);
  backend.upload(in.get(), host_x.data, in_bytes);
  TensorView x = host_x;
  x.data = in.get();
  x.device = backend.device();
  QuantizedBuffers row(backend, res.rowwise), col(backend, res.columnwise);
  backend.quantize(x, cfg, cfg.rowwise.enabled ? &row.view : nullptr,
                   cfg.columnwise.enabled ? &col.view : nullptr);
  backend.synchronize();
  if (cfg.rowwise.enabled) row.download_to(backend, res.rowwise);
  if (cfg.columnwise.enabled) col.download_to(backend, res.columnwise);
  return res;
}

std::vector<float> dequantize_to_host(Backend& backend, QuantizedHost& q) {
  QuantizedBuffers in = QuantizedBuffers::uploaded(backend, q);
  BackendBuffer out(backend, static_cast<size_t>(q.rows * q.cols) * sizeof(float));
  TensorView o;
  o.data = out.get();
  o.dtype = DType::F32;
  o.rows = q.rows;
  o.cols = q.cols;
  o.device = backend.device();
  o.name = "dequantized";
  backend.dequantize(in.view, o);
  backend.synchronize();
  std::vector<float> host(static_cast<size_t>(q.rows * q.cols));
  backend.download(host.data(), out.get(), host.size() * sizeof(float));
  return host;
}

QuantErrorSums quant_error_sums_on(Backend& backend, const std::vector<float>& x,
                                   QuantizedHost& q) {
  if (static_cast<int64_t>(x.size()) != q.rows * q.cols)
    throw std::invalid_argument("quant_error_sums_on: x has " + std::to_string(x.size()) +
                                " values, the copy is " + shape_str(q.rows, q.cols));
  QuantizedBuffers in = QuantizedBuffers::uploaded(backend, q);
  BackendBuffer xb(backend, x.size() * sizeof(float));
  backend.upload(xb.get(), x.data(), x.size() * sizeof(float));
  return backend.quant_error_sums(f32_view(backend, xb.as<float>(), q.rows, q.cols, "x"), in.view);
}

}  // namespace fp4sim
