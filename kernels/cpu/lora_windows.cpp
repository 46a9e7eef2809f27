// LoRA shrink and expand of one fused projection for a decode step whose adapter rows lie in windows
// (backend/lora/windows.py has the layout and the torch form this must equal). Built at first use by
// kernels/cpu_lora.py. On a CPU torch's GEMMs run these shapes (7 rows, rank 16) at 3-6 GB/s where a plain
// stream of the adapter weights runs at 15-20 GB/s: here each weight is read once, by dot products (shrink)
// and broadcast multiply-adds over column blocks (expand) that the compiler vectorizes.
//
// Window k is rows [starts[k], starts[k] + counts[k]) of x and y (other rows are not touched), slot slots[k];
// counts[k] <= length. For every such row t and module j (bs[j] present):
//   buf[t, :] = scaling[slot] * x[t] @ a[slot]^T                     a: [slots, modules * rank, in]
//   y[t, col_starts[j] : col_starts[j] + N_j] += buf[t, j * rank : (j + 1) * rank] @ bs[j][slot]
// with bs[j]: [slots, rank, N_j] (rank-major). Accumulation in fp32, in a fixed order per row: a row's result
// does not depend on the other rows of the step.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kColumnBlock = 128;
constexpr int64_t kRowBlock = 8;  // rows whose sums run side by side: independent chains keep the FMA units busy
constexpr int64_t kLanes = 16;

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat32 && t.stride(1) == 1,
              name, " must be a 2-D float32 tensor with contiguous rows");
}

}  // namespace

void lora_windows(torch::Tensor y, torch::Tensor x, torch::Tensor a, std::vector<std::optional<torch::Tensor>> bs,
                  std::vector<int64_t> col_starts, std::vector<int64_t> slots, std::vector<int64_t> starts,
                  std::vector<int64_t> counts, int64_t length, torch::Tensor scaling) {
  check_rows(y, "y");
  check_rows(x, "x");
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && a.scalar_type() == torch::kFloat32, "a: contiguous [slots, R, in]");
  TORCH_CHECK(scaling.is_contiguous() && scaling.scalar_type() == torch::kFloat32, "scaling: contiguous float32");
  const int64_t num = static_cast<int64_t>(slots.size()), modules = static_cast<int64_t>(bs.size());
  const int64_t ranks = a.size(1), in = a.size(2), rank = ranks / modules;
  TORCH_CHECK(modules > 0 && rank * modules == ranks && x.size(1) == in, "a's ranks or inputs do not fit");
  TORCH_CHECK(counts.size() == slots.size() && starts.size() == slots.size() && col_starts.size() == bs.size(),
              "one start and count per slot, one column start per module");
  std::vector<const float*> b_ptr(modules, nullptr);
  std::vector<int64_t> b_cols(modules, 0);
  for (int64_t j = 0; j < modules; ++j) {
    if (!bs[j].has_value()) continue;
    const torch::Tensor& b = *bs[j];
    TORCH_CHECK(b.dim() == 3 && b.is_contiguous() && b.scalar_type() == torch::kFloat32 && b.size(1) == rank &&
                b.size(0) == a.size(0), "bs[j]: contiguous float32 [slots, rank, N_j]");
    TORCH_CHECK(col_starts[j] >= 0 && col_starts[j] + b.size(2) <= y.size(1), "a module's columns lie outside y");
    b_ptr[j] = b.data_ptr<float>();
    b_cols[j] = b.size(2);
  }
  for (int64_t k = 0; k < num; ++k) {
    TORCH_CHECK(slots[k] >= 0 && slots[k] < a.size(0) && counts[k] >= 0 && counts[k] <= length, "a bad window");
    TORCH_CHECK(starts[k] >= 0 && starts[k] + counts[k] <= std::min(x.size(0), y.size(0)),
                "a window spans more rows than x or y");
    TORCH_CHECK(k == 0 || starts[k - 1] + counts[k - 1] <= starts[k], "windows must be in row order, apart");
  }
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* sp = scaling.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);

  at::parallel_for(0, num, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(length * ranks);
    const std::vector<float> zeros(in, 0.f);  // stands in for the rows a last block of the window lacks
    for (int64_t k = begin; k < end; ++k) {
      const int64_t slot = slots[k], rows = counts[k], first = starts[k];
      const float scale = sp[slot];
      for (int64_t i0 = 0; i0 < rows; i0 += kRowBlock) {  // shrink, kRowBlock rows at a time
        const float* x_rows[kRowBlock];
        for (int64_t i = 0; i < kRowBlock; ++i) x_rows[i] = i0 + i < rows ? xp + (first + i0 + i) * ldx : zeros.data();
        for (int64_t r = 0; r < ranks; ++r) {  // each row of A read once, against the rows' independent sums
          const float* a_row = ap + (slot * ranks + r) * in;
          float acc[kRowBlock][kLanes] = {};
          int64_t c = 0;
          for (; c + kLanes <= in; c += kLanes) {
            for (int64_t i = 0; i < kRowBlock; ++i) {
#pragma omp simd
              for (int64_t l = 0; l < kLanes; ++l) acc[i][l] += x_rows[i][c + l] * a_row[c + l];
            }
          }
          for (int64_t i = 0; i0 + i < rows && i < kRowBlock; ++i) {
            float sum = 0.f;
            for (int64_t l = 0; l < kLanes; ++l) sum += acc[i][l];
            for (int64_t t = c; t < in; ++t) sum += x_rows[i][t] * a_row[t];
            buf[(i0 + i) * ranks + r] = sum * scale;
          }
        }
      }
      for (int64_t j = 0; j < modules; ++j) {  // expand: a [rank, kColumnBlock] block of B, reused by the rows
        if (b_ptr[j] == nullptr) continue;
        const int64_t cols = b_cols[j];
        const float* b_slot = b_ptr[j] + slot * rank * cols;
        for (int64_t c0 = 0; c0 < cols; c0 += kColumnBlock) {
          const int64_t width = std::min(kColumnBlock, cols - c0);
          for (int64_t i = 0; i < rows; ++i) {
            float acc[kColumnBlock] = {0.f};
            const float* u = buf.data() + i * ranks + j * rank;
            for (int64_t r = 0; r < rank; ++r) {
              const float v = u[r];
              const float* b_row = b_slot + r * cols + c0;
#pragma omp simd
              for (int64_t c = 0; c < width; ++c) acc[c] += v * b_row[c];
            }
            float* y_row = yp + (first + i) * ldy + col_starts[j] + c0;
#pragma omp simd
            for (int64_t c = 0; c < width; ++c) y_row[c] += acc[c];
          }
        }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_windows", &lora_windows, "LoRA shrink + expand of one fused projection over a decode step's windows");
}
