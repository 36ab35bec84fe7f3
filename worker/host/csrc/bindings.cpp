// Python names of the CPU kernels (loaded by worker/cpu_kernels.py).

// pybind11 with torch's Tensor casters, not all of torch (<torch/extension.h>, whose parse
// was most of the build's time).
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"
#include "linear.h"
#include "packed_linear.h"
#include "skinny_linear.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &conveyor::paged_decode,
        "decode attention over a paged KV cache (CPU)");
  // The whole step runs without the GIL: the worker's I/O threads keep going meanwhile.
  m.def("decode_layers", &conveyor::decode_layers,
        "every decoder layer, the final norm and the LM head (given) of a decode-only step, "
        "float32 (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("step_team_counts", &conveyor::step_team_counts,
        "(tasks taken over, tasks partners published) by decode_layers' step team so far");
  m.def("step_team_stall", &conveyor::step_team_stall,
        "test hook: the step team's partners sleep micros before every every-th publication");
  m.def("skinny_linear", &conveyor::skinny_linear,
        "x @ weight.T (+ bias) for a few rows of x, float32 (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("sample_rows", &conveyor::sample_rows,
        "one token per row from filtered probabilities, float32 (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &conveyor::argmax_rows,
        "the index of each row's largest value, as torch.argmax(dim=-1), float32 (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("penalize", &conveyor::penalize,
        "repetition, presence and frequency penalties in place, float32 (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("mask_rows", &conveyor::mask_rows,
        "structured outputs' token masks in place: -inf where a row's bit is clear, "
        "float32 (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("packed_linear", &conveyor::packed_linear,
        "x @ weight.T (+ bias) from pack_weight(weight), float32 (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_weight", &conveyor::pack_weight,
        "weight [N, K] in panels for packed_linear, float32 (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear", &conveyor::linear,
        "x @ weight.T (+ bias), float32 (CPU): the packed or skinny kernel, oneDNN or the BLAS",
        py::call_guard<py::gil_scoped_release>());
  m.def("bind_team", &conveyor::bind_team,
        "pin each thread of the calling thread's OpenMP team to a CPU of its own (Linux)",
        py::call_guard<py::gil_scoped_release>());
  m.attr("HAS_ONEDNN_LINEAR") = conveyor::has_onednn_linear();
  m.attr("SKINNY_MAX_ROWS") = conveyor::kSkinnyMaxRows;
  m.attr("PACKED_MAX_ROWS") = conveyor::kPackedMaxRows;
}
